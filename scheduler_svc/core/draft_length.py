"""The draft length of a speculative step (``--speculative-config``): the k in [0, k_max] that gives
the most output tokens per unit of step cost, from the measured acceptance, the proposer's coverage
and the executor's step cost, and checked against what drafting steps actually gave. Pure: counts
and milliseconds in, k out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.6  # what the policy assumes before it has measured anything
PRIOR_COVERAGE = 1.0  # the share of rows the proposer finds drafts for, before anything is measured
# ... held as this many rows asked: a request's first tokens, which repeat nothing yet, must not end drafting at once
PRIOR_COVERAGE_WEIGHT = 4.0
DECAY = 0.9  # weight of the acceptance measured so far against a new step's
FORGET = 0.02  # per step without drafts, the acceptance estimate drifts this far back to the prior
# Per step that asks for no drafts, the coverage estimate drifts this far back to its prior: slower, as each retry
# costs a step of the loop's pipelining while the proposer may well find nothing again (one step in ~20 at batch 1).
COVERAGE_FORGET = 0.005
# Drafts must promise this many times k = 0's tokens per unit of step cost. Not a hair above 1: alpha and coverage
# are means over rows that differ, the step cost is measured on shared cores, and a drafting loop gives up its
# pipelining; at 32 rows on 2 cores a predicted 5-10% gain measured as anything from a 25% loss to a 10% gain.
MIN_GAIN = 1.15
COST_DECAY = 0.9  # weight of a range's step costs measured so far against a new step's in it
COST_MIN_WEIGHT = 3.0  # the measured line replaces the prior once this much weight is in
# ``Outcomes``: drafting steps measured in a range of batch sizes before their outcome may stop drafting there, how
# many steps without drafts the range then holds off, at first and at most (the hold doubles with each failed retry).
OUTCOME_MIN_WEIGHT = sum(DECAY**i for i in range(5)) - 1e-9  # five steps
OUTCOME_HOLD = 64
OUTCOME_MAX_HOLD = 1024


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a row yields with ``k`` drafts each accepted with probability ``alpha`` (stopping
    at the first rejection): 1 + alpha + ... + alpha^k."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(slots=True)
class StepCost:
    """What a step of ``T`` tokens costs the executor, in ms, measured on recent steps whose rows all
    decode (with or without drafts), and for a step that drafts, plus how much longer the executor
    waits for its plan than for a plan without drafts (a drafting plan is built only after the last
    result is in: the pipelined loop's overlap is lost).

    The curve is a set of points, one per power-of-two range of T (the decayed means of the steps'
    tokens and times in it, ``COST_DECAY`` per step in that range), made non-decreasing, joined by
    straight lines, flat below the first, and continued past the last along the last two's slope (one
    point alone: along the prior's shape). A straight line over every size would not do: the step is
    flat while the weights' reading dominates and rises once it is compute-bound (on a 2-core CPU from
    a dozen tokens, on a GPU from hundreds), and a line fitted to batch-1 steps would call drafts at
    32 rows cheap. Near the batch that runs, the points are fresh; a range left unused keeps its last
    figure until a step lands there again.

    Before ``COST_MIN_WEIGHT`` of measurements, and always unless ``measured``, the prior: ``max(1, T /
    compute_bound_tokens)`` decode steps (a GPU's shape).
    """

    compute_bound_tokens: int = 256
    measured: bool = True
    _ranges: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # T.bit_length() -> w, sum T, ms
    _waits: dict[bool, tuple[float, float]] = field(default_factory=dict)  # drafted -> (weight, sum of waits)

    def observe(self, tokens: int, step_ms: float, drafted: bool, wait_ms: float) -> None:
        """A reported step of ``tokens`` (every row decoding, with or without drafts): the executor's
        ``step_ms``, and ``wait_ms``, its wait for the plan after its previous step."""
        if not self.measured or tokens < 1 or step_ms <= 0:
            return
        d = COST_DECAY
        w, t, ms = self._ranges.get(tokens.bit_length(), (0.0, 0.0, 0.0))
        if w >= 1.0:  # one step slowed by a passing process must not swing its range (a new range takes it whole)
            step_ms = min(max(step_ms, 0.5 * ms / w), 2.0 * ms / w)
        self._ranges[tokens.bit_length()] = (d * w + 1, d * t + tokens, d * ms + step_ms)
        w, total = self._waits.get(drafted, (0.0, 0.0))
        self._waits[drafted] = (d * w + 1, d * total + min(wait_ms, step_ms))  # a longer wait was an idle loop

    @property
    def fitted(self) -> bool:
        return sum(w for w, _, _ in self._ranges.values()) >= COST_MIN_WEIGHT

    def points(self) -> list[tuple[float, float]]:
        """(tokens, ms) per measured range, by tokens, each ms at least the one before."""
        out: list[tuple[float, float]] = []
        for _, (w, t, ms) in sorted(self._ranges.items()):
            out.append((t / w, max(ms / w, out[-1][1] if out else 0.0)))
        return out

    def trusted(self) -> float:
        """Steps up to how many tokens the curve may be taken at its word for: twice the largest measured
        (the prior, before any: as many as any)."""
        if not self.fitted:
            return math.inf
        return 2 * max(t / w for w, t, _ in self._ranges.values())

    def wait(self, drafted: bool) -> float:
        """ms the executor waited for a plan, on average over recent steps with (or without) drafts."""
        w, total = self._waits.get(drafted, (0.0, 0.0))
        return total / w if w else 0.0

    def draft_wait(self) -> float:
        """ms the executor waits longer for a drafting plan than for one without drafts."""
        return max(0.0, self.wait(True) - self.wait(False))

    def _prior(self, tokens: float) -> float:
        return max(1.0, tokens / self.compute_bound_tokens)

    def __call__(self, tokens: float, drafting: bool = False) -> float:
        if not self.fitted:
            return self._prior(tokens)
        pts = self.points()
        (x0, y0), (x1, y1) = pts[-2] if len(pts) > 1 else pts[-1], pts[-1]
        if tokens <= pts[0][0]:
            ms = pts[0][1]
        elif tokens >= x1:
            ms = y1 + (y1 - y0) / (x1 - x0) * (tokens - x1) if x1 > x0 else y1 * self._prior(tokens) / self._prior(x1)
        else:
            i = next(i for i, (x, _) in enumerate(pts) if x >= tokens)
            (xa, ya), (xb, yb) = pts[i - 1], pts[i]
            ms = ya + (yb - ya) * (tokens - xa) / (xb - xa)
        return ms + (self.draft_wait() if drafting else 0.0)


@dataclass(slots=True)
class _Range:
    weight: float = 0.0
    gains: float = 0.0  # decayed sum, as weight
    hold: int = 0  # steps left without drafts
    next_hold: int = OUTCOME_HOLD


@dataclass(slots=True)
class Outcomes:
    """What drafting steps actually cost, per power-of-two range of decoding rows: each step's output
    tokens per ms (the tokens its drafts are expected to give at the measured acceptance, over the step
    and its wait for the plan) against what the same step without drafts would have given (``StepCost``'s
    curve at its tokens without drafts, and the wait of a plan without drafts).

    The policy's choice rests on a step cost by tokens alone and a coverage averaged over rows, and a
    step of 32 rows can defeat them: the drafted rows ride in a step whose cost is set by its rows'
    contexts, and a drafting plan gives up the loop's overlap. (Acceptance is ``alpha``'s to judge: a
    step's own rejections, at batch 1, must not stop drafting there.) A range whose drafting
    steps (five, decayed) measured below break-even drafts nothing for ``OUTCOME_HOLD`` steps, then measures afresh;
    each retry that loses again doubles the hold (up to ``OUTCOME_MAX_HOLD``), one that wins resets it.
    """

    _ranges: dict[int, _Range] = field(default_factory=dict)  # rows.bit_length() -> range

    def observe(self, rows: int, gain: float) -> None:
        """A drafting step of ``rows`` decoding rows that gave ``gain`` times a plain step's tokens per ms."""
        r = self._ranges.setdefault(rows.bit_length(), _Range())
        r.weight, r.gains = DECAY * r.weight + 1, DECAY * r.gains + gain
        if r.weight < OUTCOME_MIN_WEIGHT:
            return
        if r.gains / r.weight < 1.0:
            r.hold, r.weight, r.gains = r.next_hold, 0.0, 0.0  # the retry measures afresh
            r.next_hold = min(2 * r.next_hold, OUTCOME_MAX_HOLD)
        else:
            r.next_hold = OUTCOME_HOLD

    def step(self) -> None:
        """A step that drafted nothing: the holds run down."""
        for r in self._ranges.values():
            r.hold = max(0, r.hold - 1)

    def holds(self, rows: int) -> bool:
        r = self._ranges.get(rows.bit_length())
        return r is not None and r.hold > 0


@dataclass(slots=True)
class DraftPolicy:
    """The step's draft length: the k in [0, k_max] that maximises output tokens per unit of step
    cost, ``(1 + coverage x (expected_tokens(alpha, k) - 1)) / cost(tokens + coverage x rows x k)``
    (``StepCost``: measured, from a prior of ``max(1, T / compute_bound_tokens)``; a drafting step
    also pays the executor's longer wait for its plan), against k = 0 (one token per row at
    ``cost(tokens)``); a k > 0 must promise ``MIN_GAIN`` times k = 0's, which also turns drafting off
    when little is accepted, when the proposer finds little to draft, or when the step is
    compute-bound. k = 0 matters beyond the step: a loop that would draft plans only with no plan
    in flight (the drafts follow each request's last token), one that would not pipelines.

    ``alpha``: the measured per-draft acceptance, ``accepted / (accepted + rejections)`` over the
    recent drafting steps (the estimate of a geometric acceptance from truncated runs); ``coverage``:
    the measured share of the rows drafts were asked for that got some (prompt lookup finds nothing
    in text that repeats nothing). Both start from a prior and drift back to it while nothing is
    drafted (else one bad stretch would turn speculation off for good: the drift is how the policy
    tries again). A step of more than ``disable_by_batch_size`` running requests drafts nothing; with
    large batches the cost model gives k = 0 on its own, and where it misjudges, ``Outcomes`` (what
    drafting steps of that many rows measured) holds drafting off.
    """

    k_max: int
    compute_bound_tokens: int = 256
    disable_by_batch_size: int = 0
    measured: bool = True  # the step cost is measured (else ``compute_bound_tokens``' model, fixed)
    adaptive: bool = True  # else every step that may draft asks for k_max (``adaptive_draft_length``)
    alpha: float = PRIOR_ACCEPTANCE
    coverage: float = PRIOR_COVERAGE
    cost: StepCost = field(init=False)
    outcomes: Outcomes = field(default_factory=Outcomes)
    _accepted: float = 0.0
    _rejected: float = 0.0
    _proposed: float = PRIOR_COVERAGE * PRIOR_COVERAGE_WEIGHT
    _asked: float = PRIOR_COVERAGE_WEIGHT

    def __post_init__(self) -> None:
        self.cost = StepCost(self.compute_bound_tokens, self.measured)

    def choose(self, rows: int, tokens: int) -> int:
        """``rows``: decoding rows that could draft; ``tokens``: the step's tokens without drafts."""
        if rows < 1 or (self.disable_by_batch_size and rows > self.disable_by_batch_size):
            return 0
        if not self.adaptive:
            return self.k_max
        if self.outcomes.holds(rows):
            return 0
        base, c, trusted = self.cost(tokens), self.coverage, self.cost.trusted()
        best_k, best = 0, MIN_GAIN
        for k in range(1, self.k_max + 1):
            if tokens + c * rows * k > trusted:
                break  # past what the curve has seen: found out a doubling at a time, never with one huge step
            gain = (1 + c * (expected_tokens(self.alpha, k) - 1)) * base / self.cost(tokens + c * rows * k, True)
            if gain > best * (1 + 1e-9):
                best_k, best = k, gain
        return best_k

    def observe(self, accepted: int, rejections: int) -> None:
        """A step's outcome: drafts accepted, and rows whose drafts were cut by a rejection."""
        if accepted == 0 and rejections == 0:
            self.alpha += FORGET * (PRIOR_ACCEPTANCE - self.alpha)
            return
        self._accepted = DECAY * self._accepted + accepted
        self._rejected = DECAY * self._rejected + rejections
        self.alpha = self._accepted / (self._accepted + self._rejected)

    def stepped(self, drafts: list[int], tokens: int, step_ms: float, wait_ms: float) -> None:
        """A reported step whose rows all decode, ``drafts`` per row (``tokens`` without them): a drafting
        one is scored against the cost curve as it stood (``observe_step``), then every one joins the curve."""
        if any(drafts):
            self.observe_step(drafts, tokens, step_ms, wait_ms)
        self.cost.observe(tokens + sum(drafts), step_ms, any(drafts), wait_ms)

    def observe_step(self, drafts: list[int], tokens: int, step_ms: float, wait_ms: float) -> None:
        """A reported drafting step whose rows all decode, ``drafts`` per row: ``tokens`` the step's tokens
        without drafts, the executor's ``step_ms`` and its ``wait_ms`` for the plan. Its outcome counts
        against the cost curve's plain step, with the tokens the measured acceptance expects of its drafts
        (acceptance has its own estimate, ``alpha``; what is judged here is what a step with these drafts
        cost: a row or two rejected at batch 1 must not stop drafting there). Only once the curve is
        measured: the prior is in decode steps, not ms."""
        rows = len(drafts)
        if not (self.adaptive and self.measured and self.cost.fitted) or rows < 1 or step_ms <= 0:
            return
        expected = sum(expected_tokens(self.alpha, d) for d in drafts)
        plain = self.cost(tokens) + self.cost.wait(False)
        self.outcomes.observe(rows, expected / rows * plain / (step_ms + min(wait_ms, step_ms)))

    def observe_proposals(self, proposed: int, asked: int) -> None:
        """A step's proposals: rows that got drafts of the ``asked`` rows drafts were asked for."""
        if asked == 0:
            self.coverage += COVERAGE_FORGET * (PRIOR_COVERAGE - self.coverage)
            self.outcomes.step()
            return
        self._proposed = DECAY * self._proposed + proposed
        self._asked = DECAY * self._asked + asked
        self.coverage = self._proposed / self._asked
