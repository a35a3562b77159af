"""The draft length policy on plain data (``core/draft_length.py``): the k it chooses from the measured
acceptance, coverage and step cost, and the outcomes of drafting steps that hold it off."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from scheduler_svc.core import draft_length as dl


def test_policy_drafts_at_small_batches_and_stops_when_compute_bound() -> None:
    pol = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    assert pol.choose(1, 1) == 5  # a step of a few tokens costs what one costs
    assert pol.choose(32, 32) == 5
    assert 0 < pol.choose(64, 64) < 5  # 64 x 5 drafts would make the step compute-bound
    assert pol.choose(256, 256) == 0  # compute-bound: drafts only cost
    assert pol.choose(0, 0) == 0
    assert dl.DraftPolicy(5, 256, disable_by_batch_size=4).choose(8, 8) == 0
    for _ in range(50):
        pol.observe(0, 1)  # nothing accepted
    assert pol.alpha < 0.01 and pol.choose(1, 1) == 0
    for _ in range(500):
        pol.observe(0, 0)  # steps without drafts: back towards the prior
    assert pol.choose(1, 1) > 0
    assert dl.expected_tokens(0.5, 2) == 1.75 and dl.expected_tokens(1.0, 3) == 4


def smollm2_on_2_cores(tokens: int) -> float:
    """SmolLM2's step on the project's 2-core CPU (``Engine.step``, quiet): flat while reading the weights
    dominates, then ~0.9 ms per token (1 row 22 ms, 1 + 5 drafts 24 ms, 32 rows 60 ms, 64 tokens 91 ms)."""
    return 22.0 + 0.9 * max(0, tokens - 10)


def feed(pol: dl.DraftPolicy, cost: Callable[[int], float], sizes: range, wait: float = 0.0) -> None:
    """A step of every size in ``sizes``, costing ``cost(T)`` ms, a few times over; a step of more
    tokens than ``sizes`` starts with counts as drafting, and waited ``wait`` ms for its plan."""
    for _ in range(4):
        for t in sizes:
            drafted = t > sizes.start
            pol.cost.observe(t, cost(t), drafted, wait if drafted else 0.0)


def test_the_draft_length_follows_the_measured_step_cost() -> None:
    """On 2 CPU cores: drafts at batch 1, none at 32 rows (a drafted token costs nearly what a sampled
    one does); a flat step (a GPU's, the weights read once) drafts at 32 too; the executor's longer
    wait for a drafting plan counts against drafts."""
    cpu = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    feed(cpu, smollm2_on_2_cores, range(1, 7))  # batch 1, up to 5 drafts
    feed(cpu, smollm2_on_2_cores, range(32, 200, 8))  # 32 rows, up to 5 drafts each
    assert cpu.cost(1) == pytest.approx(22.0) and cpu.cost(64) == pytest.approx(smollm2_on_2_cores(64), rel=0.1)
    assert cpu.choose(1, 1) == 5
    assert cpu.choose(32, 32) == 0 and cpu.choose(16, 16) <= 1
    flat = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    feed(flat, lambda t: 20.0 + 0.01 * t, range(32, 200, 8))
    assert flat.choose(32, 32) == 5
    slow_loop = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    feed(slow_loop, lambda t: 20.0 + 0.01 * t, range(32, 200, 8), wait=10.0)
    assert slow_loop.cost.draft_wait() == pytest.approx(10.0)
    flat.alpha = slow_loop.alpha = 0.3  # drafts that pay for a flat step, not for a 50% longer wait as well
    assert flat.choose(32, 32) > 0 and slow_loop.choose(32, 32) == 0
    waits = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    feed(waits, lambda t: 20.0, range(32, 200, 8), wait=25.0)
    assert waits.cost.draft_wait() == pytest.approx(20.0)  # a wait longer than the step was an idle loop
    before = cpu.cost(32)
    for _ in range(3):  # a step slowed 100x by another process counts as 2x at most
        cpu.cost.observe(32, 5000.0, False, 0.0)
    assert cpu.cost(32) < 1.5 * before and cpu.choose(1, 1) >= 4


def test_batch_1_steps_do_not_make_drafts_at_32_rows_look_cheap() -> None:
    """Measured at batch 1 only, the curve is nearly flat, and says nothing of 32 rows: it is trusted up
    to twice the largest step measured, so no drafts there; the first steps of 32 rows (no drafts) set
    its slope past them from the last two ranges, and drafting at 32 rows is judged on that."""
    pol = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    assert pol.cost.trusted() == math.inf  # the prior, before anything is measured
    feed(pol, smollm2_on_2_cores, range(1, 12))
    assert pol.choose(1, 1) == 5 and pol.cost.trusted() < 32 and pol.choose(32, 32) == 0
    feed(pol, smollm2_on_2_cores, range(32, 33))
    assert pol.cost.trusted() == 64 and pol.cost(64) > 1.5 * pol.cost(32) and pol.choose(32, 32) == 0


def test_a_step_in_a_new_range_counts_whole() -> None:
    """A flat curve (a GPU's) measured up to 64 tokens lets 32 rows draft into steps of up to 128; the
    first one, far dearer than the curve's guess, counts whole (only a range's own figure bounds a
    step's: bounded by the guess, the suffix loop drafted on and on at 32 rows on 2 cores), and the
    drafts fall back to steps the curve has measured cheap."""
    pol = dl.DraftPolicy(k_max=24, compute_bound_tokens=256)
    feed(pol, lambda t: 20.0 + 0.05 * t, range(32, 65))
    k = pol.choose(32, 32)
    assert k > 0 and 32 * (1 + k) <= pol.cost.trusted()
    guess = pol.cost(32 * (1 + k))
    pol.cost.observe(32 * (1 + k), 4 * guess, True, 0.0)
    assert pol.cost(32 * (1 + k)) == pytest.approx(4 * guess)
    assert 0 < pol.choose(32, 32) < k and 32 * (1 + pol.choose(32, 32)) <= 64


def test_a_given_compute_bound_is_the_model_whatever_is_measured() -> None:
    fixed = dl.DraftPolicy(k_max=5, compute_bound_tokens=256, measured=False)
    feed(fixed, smollm2_on_2_cores, range(32, 200, 8))
    assert not fixed.cost.fitted and fixed.cost(32) == 1.0 and fixed.choose(32, 32) == 5


def test_a_fixed_draft_length_drafts_k_max_whatever_is_measured() -> None:
    """``adaptive_draft_length: false``: nothing accepted, nothing found, compute-bound steps; still k max
    (but not past ``disable_by_batch_size``, and not for a step with no row to draft)."""
    fixed = dl.DraftPolicy(k_max=4, disable_by_batch_size=16, adaptive=False)
    for _ in range(50):
        fixed.observe(0, 3)
        fixed.observe_proposals(0, 8)
    feed(fixed, smollm2_on_2_cores, range(32, 200, 8))
    assert fixed.alpha < 0.1 and fixed.coverage < 0.1
    assert [fixed.choose(rows, rows) for rows in (1, 8, 16)] == [4, 4, 4]
    assert fixed.choose(17, 17) == 0 and fixed.choose(0, 0) == 0
    adaptive = dl.DraftPolicy(k_max=4, disable_by_batch_size=16)
    for _ in range(50):
        adaptive.observe(0, 3)
    assert adaptive.choose(1, 1) == 0, "the same history turns an adaptive policy's drafting off"


def test_one_size_of_step_goes_on_along_the_priors_shape() -> None:
    pol = dl.DraftPolicy(k_max=4, compute_bound_tokens=64)
    assert pol.cost(32) == 1.0 and pol.cost(128) == 2.0  # the prior, in decode steps
    for _ in range(10):
        pol.cost.observe(8, 30.0, False, 0.0)
    assert pol.cost.points() == [(pytest.approx(8.0), pytest.approx(30.0))]
    assert pol.cost(4) == pol.cost(64) == pytest.approx(30.0) and pol.cost(128) == pytest.approx(60.0)


def lose(pol: dl.DraftPolicy, rows: int, steps: int, gain: float = 0.7) -> None:
    """``steps`` drafting steps of ``rows`` rows, one draft each, that give ``gain`` x a plain step's tokens per ms
    at the policy's acceptance."""
    plain = pol.cost(rows) + pol.cost.wait(False)
    expected = rows * dl.expected_tokens(pol.alpha, 1)
    for _ in range(steps):
        pol.observe_step([1] * rows, rows, plain * expected / rows / gain, 0.0)


def test_drafting_steps_that_lose_hold_drafting_off_in_their_range() -> None:
    """A flat measured curve (a GPU's) makes drafts at 32 rows look cheap; the drafting steps there
    measure 0.7x a plain step's tokens per ms, so that range drafts nothing for ``OUTCOME_HOLD`` steps,
    then tries again, and a retry that loses again holds twice as long; 4 rows keep drafting, and a
    range whose drafting pays is never held."""
    pol = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    feed(pol, lambda t: 20.0 + 0.01 * t, range(32, 200, 8))
    k = pol.choose(32, 32)
    assert k > 0 and pol.choose(4, 4) > 0
    lose(pol, 32, 4)
    assert pol.choose(32, 32) == k, "four steps are not yet a measurement"
    lose(pol, 32, 1)
    assert pol.choose(32, 32) == 0 and pol.choose(40, 40) == 0 and pol.choose(4, 4) > 0  # 32-63 rows held
    for _ in range(dl.OUTCOME_HOLD - 1):
        pol.observe_proposals(0, 0)  # steps without drafts
    assert pol.choose(32, 32) == 0
    pol.observe_proposals(0, 0)
    assert pol.choose(32, 32) == k, "the hold ran out: it tries again"
    lose(pol, 32, 5)
    for _ in range(2 * dl.OUTCOME_HOLD - 1):
        pol.observe_proposals(0, 0)
    assert pol.choose(32, 32) == 0, "a second loss holds twice as long"
    pol.observe_proposals(0, 0)
    assert pol.choose(32, 32) == k
    lose(pol, 32, 20, gain=1.3)  # drafting that pays
    assert pol.choose(32, 32) == k


def test_an_outcome_counts_the_longer_wait_of_a_drafting_plan() -> None:
    """The same step time, but the executor waited half a step longer for each drafting plan (the loop's
    overlap lost): 1.2x the tokens do not pay for 1.5x the time."""
    pol = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    pol.alpha = 0.2  # one draft per row: 1.2 tokens expected
    feed(pol, lambda t: 100.0, range(32, 200, 8))
    for _ in range(5):
        pol.observe_step([1] * 32, 32, 100.0, 50.0)
    assert pol.outcomes.holds(32)
    won = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    won.alpha = 0.2
    feed(won, lambda t: 100.0, range(32, 200, 8))
    for _ in range(5):
        won.observe_step([1] * 32, 32, 100.0, 0.0)
    assert not won.outcomes.holds(32)


def test_a_steps_own_rejections_do_not_hold_drafting_off() -> None:
    """At batch 1 a drafting step costs what a plain one does: the outcome takes the tokens the measured
    acceptance expects of the step's drafts, not what this step's row accepted (acceptance is ``alpha``'s to
    judge, over many steps), so steps whose drafts happened to be rejected stay above break-even, while
    the same steps at 2.5x a plain step's cost do not."""
    pol = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    feed(pol, lambda t: 22.0 + 0.1 * t, range(1, 7))
    assert pol.alpha == dl.PRIOR_ACCEPTANCE
    for _ in range(10):
        pol.observe_step([5], 1, 22.6, 0.0)
    assert not pol.outcomes.holds(1)
    dear = dl.DraftPolicy(k_max=5, compute_bound_tokens=256)
    feed(dear, lambda t: 22.0 + 0.1 * t, range(1, 7))
    for _ in range(5):
        dear.observe_step([5], 1, 2.5 * 22.6, 0.0)
    assert dear.outcomes.holds(1)


def test_outcomes_wait_for_a_measured_curve_and_an_adaptive_policy() -> None:
    """Before the step cost is measured its prior is in decode steps, not ms: no outcome counts yet;
    nor with a fixed draft length or a given compute bound."""
    for pol in (
        dl.DraftPolicy(k_max=5),
        dl.DraftPolicy(k_max=5, adaptive=False),
        dl.DraftPolicy(k_max=5, measured=False),
    ):
        for _ in range(10):
            pol.observe_step([1] * 32, 32, 1000.0, 0.0)
        assert not pol.outcomes.holds(32) and pol.choose(32, 32) == 5
