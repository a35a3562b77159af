"""Speculative decoding, the scheduler's side: ``--speculative-config``, the draft proposers and
the draft length policy. Pure: plain token lists in, drafts out.

The scheduler proposes because it holds every request's prompt and output tokens (the executor
holds only their KV, and a token history for the few requests whose sampling needs it). Drafts
travel in the plan (``SeqPlan.draft_token_ids``); the executor scores them in the step's packed
forward and keeps the longest prefix its own sampler agrees with (``executor_svc/verify.py``).

Two proposers, neither with a model:
- ``ngram`` (prompt lookup, as vLLM): the longest suffix of the request's tokens, of length in
  ``[prompt_lookup_min, prompt_lookup_max]``, that occurred earlier; the drafts are the tokens that
  followed its earliest occurrence.
- ``suffix`` (SuffixDecoding, arXiv 2411.04975): a suffix trie of bounded depth over the request's
  own tokens, and one over the outputs of the last ``suffix_decoding_max_cached_requests`` finished
  requests; the longest suffix of the request's tokens found in a trie (and shorter ones, by halves)
  is followed along its most frequent continuation while the path's probability stays above
  ``suffix_decoding_min_token_prob``, for at most ``suffix_decoding_max_spec_factor`` x the match length
  tokens and the depth left below the match (the draft length follows how much matched); the best
  scoring path wins.

``DraftPolicy`` (``core/draft_length.py``) picks the step's draft length k.
"""

from __future__ import annotations

import json
import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler_svc.core.draft_length import DraftPolicy

METHODS = ("ngram", "suffix")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """vLLM's ``--speculative-config`` keys that apply here, plus ``compute_bound_tokens`` (pagedserve's)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # No drafts in a step of more running requests than this (vLLM's key); 0: no such limit.
    disable_by_batch_size: int = 0
    # The policy's cost model: a step of T tokens costs max(1, T / compute_bound_tokens) decode steps of one
    # token (the weights are read once either way until the step is compute-bound). Given in the JSON, it is
    # the model; unset (``measure_step_cost``), it is the prior of the step cost measured on the executor.
    compute_bound_tokens: int = 256
    measure_step_cost: bool = True  # not a key: whether compute_bound_tokens was left out
    # pagedserve's: false drafts num_speculative_tokens in every step that may draft (vLLM's ngram does), whatever
    # the measured acceptance, coverage and step cost say (``DraftPolicy``); drafts stay exact either way.
    adaptive_draft_length: bool = True


_INT_KEYS = (
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "disable_by_batch_size",
    "compute_bound_tokens",
)
_FLOAT_KEYS = ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")


def parse(text: str) -> SpecConfig:
    """``--speculative-config``'s JSON; ValueError naming the key that is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("must be a JSON object")
    known = {"method", "adaptive_draft_length", *_INT_KEYS, *_FLOAT_KEYS}
    for key in raw:
        if key not in known:
            raise ValueError(f"{key}: not supported (supported: {', '.join(sorted(known))})")
    method = raw.get("method")
    if method not in METHODS:
        raise ValueError(f"method: must be one of {', '.join(METHODS)}, got {method!r}")
    vals: dict[str, Any] = {"method": method}
    for key in _INT_KEYS:
        if key in raw:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{key}: must be a non-negative integer, got {v!r}")
            vals[key] = v
    for key in _FLOAT_KEYS:
        if key in raw:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{key}: must be a non-negative number, got {v!r}")
            vals[key] = float(v)
    if "adaptive_draft_length" in raw:
        if not isinstance(raw["adaptive_draft_length"], bool):
            raise ValueError(f"adaptive_draft_length: must be true or false, got {raw['adaptive_draft_length']!r}")
        vals["adaptive_draft_length"] = raw["adaptive_draft_length"]
    if "num_speculative_tokens" not in vals:
        if method == "ngram":
            raise ValueError("num_speculative_tokens: required for method ngram")
        vals["num_speculative_tokens"] = vals.get("suffix_decoding_max_tree_depth", 24)
    if vals["num_speculative_tokens"] < 1:
        raise ValueError("num_speculative_tokens: must be at least 1")
    # vLLM: one of the two bounds given stands for both.
    lo, hi = vals.get("prompt_lookup_min"), vals.get("prompt_lookup_max")
    lo, hi = lo or hi or 5, hi or lo or 5
    if lo < 1:
        raise ValueError("prompt_lookup_min: must be at least 1")
    if hi < lo:
        raise ValueError(f"prompt_lookup_max: must be >= prompt_lookup_min ({lo}), got {hi}")
    vals["prompt_lookup_min"], vals["prompt_lookup_max"] = lo, hi
    if vals.get("compute_bound_tokens", 256) < 1:
        raise ValueError("compute_bound_tokens: must be at least 1")
    vals["measure_step_cost"] = "compute_bound_tokens" not in vals
    if vals.get("suffix_decoding_max_tree_depth", 24) < 2:
        raise ValueError("suffix_decoding_max_tree_depth: must be at least 2")
    if not 0 <= vals.get("suffix_decoding_min_token_prob", 0.1) <= 1:
        raise ValueError("suffix_decoding_min_token_prob: must be in [0, 1]")
    return SpecConfig(**vals)


class Proposer(Protocol):
    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]: ...

    def finished(self, request_id: str, output: Sequence[int]) -> None: ...


# -- n-gram (prompt lookup) ----------------------------------------------------------


def ngram(tokens: Sequence[int], lo: int, hi: int, k: int) -> list[int]:
    """The ``k`` tokens after the earliest earlier occurrence of the longest suffix of ``tokens``
    of length in ``[lo, hi]`` (fewer if the tokens end first); [] when none occurred."""
    n = len(tokens)
    if k < 1 or n < lo + 1:
        return []
    # Byte search over fixed-width tokens (C speed); a hit must be token-aligned.
    data = array("q", tokens).tobytes()
    w = 8
    for m in range(min(hi, n - 1), lo - 1, -1):
        pat = data[(n - m) * w :]
        end = (n - 1) * w  # a match must end before the last token: one token at least follows it
        at = data.find(pat, 0, end)
        while at >= 0 and at % w:
            at = data.find(pat, at + 1, end)
        if at >= 0:
            i = at // w + m
            return list(tokens[i : i + k])
    return []


@dataclass(slots=True)
class NgramProposer:
    lo: int
    hi: int

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        return ngram(tokens, self.lo, self.hi, k)

    def finished(self, request_id: str, output: Sequence[int]) -> None:
        pass


# -- suffix decoding --------------------------------------------------------------------


class _Node:
    __slots__ = ("count", "kids")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the path from the root to here
        self.kids: dict[int, _Node] = {}


class SuffixTrie:
    """Every substring of the sequences added, up to ``depth`` tokens, with its count."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Add (``sign`` 1) or remove (-1) a whole sequence's substrings."""
        for i in range(len(tokens)):
            node = self.root
            node.count += sign
            for t in tokens[i : i + self.depth]:
                kid = node.kids.get(t)
                if kid is None:
                    kid = node.kids[t] = _Node()
                kid.count += sign
                if kid.count <= 0:
                    del node.kids[t]
                    break
                node = kid

    def match(self, tokens: Sequence[int], longest: int) -> tuple[_Node, int] | None:
        """The node of the longest suffix of ``tokens`` (at most ``longest`` long) in the trie."""
        for m in range(min(longest, len(tokens)), 0, -1):
            node: _Node | None = self.root
            for t in tokens[len(tokens) - m :]:
                node = node.kids.get(t) if node is not None else None
                if node is None:
                    break
            if node is not None:
                return node, m
        return None

    def find(self, tokens: Sequence[int]) -> _Node | None:
        """The node of ``tokens`` (at most ``depth`` long), if the trie holds them."""
        node: _Node | None = self.root
        for t in tokens:
            node = node.kids.get(t) if node is not None else None
        return node

    def follow(self, node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation from ``node``: tokens, and the sum of their path probabilities."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit and node.kids and node.count > 0:
            t, kid = max(node.kids.items(), key=lambda kv: kv[1].count)
            prob *= kid.count / node.count
            if prob < min_prob:
                break
            out.append(t)
            score += prob
            node = kid
        return out, score


class _Growing:
    """A request's own trie, extended by the tokens it gained since it was last looked at."""

    __slots__ = ("active", "seen", "trie")

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.seen = 0
        self.active: list[tuple[_Node, int]] = []  # (node, its depth) for the suffixes still growing

    def extend(self, tokens: Sequence[int]) -> None:
        root, depth = self.trie.root, self.trie.depth
        for t in tokens[self.seen :]:
            root.count += 1
            grown: list[tuple[_Node, int]] = []
            for node, d in [*self.active, (root, 0)]:
                kid = node.kids.get(t)
                if kid is None:
                    kid = node.kids[t] = _Node()
                kid.count += 1
                if d + 1 < depth:
                    grown.append((kid, d + 1))
            self.active = grown
        self.seen = len(tokens)


@dataclass(slots=True)
class SuffixProposer:
    depth: int = 24
    max_cached: int = 256
    spec_factor: float = 1.0
    min_prob: float = 0.1
    _mine: dict[str, _Growing] = field(default_factory=dict)
    _recent: deque[tuple[int, ...]] = field(default_factory=deque)
    _cache: SuffixTrie | None = None

    def __post_init__(self) -> None:
        self._cache = SuffixTrie(self.depth)

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        if k < 1:
            return []
        own = self._mine.get(request_id)
        if own is None or own.seen > len(tokens):
            own = self._mine[request_id] = _Growing(self.depth)
        # Match on what the request had before its last token was added, so that the match's own
        # occurrence (the suffix just added) is not its only continuation.
        best: tuple[list[int], float] = ([], 0.0)
        own.extend(tokens[:-1])
        assert self._cache is not None
        for trie in (own.trie, self._cache):
            hit = trie.match(tokens, self.depth - 1)  # a token of room at least below the match
            if hit is None:
                continue
            # The longest suffix found, and shorter ones by halves: a match of m tokens leaves depth - m
            # below it for drafts (a whole quoted line matched 23 deep in a trie of 24 drafts one token),
            # and SuffixDecoding takes the match length whose path scores best.
            node, m = hit
            while True:
                limit = min(k, self.depth - m, max(1, math.ceil(self.spec_factor * m)))
                drafts, score = trie.follow(node, limit, self.min_prob)
                if score > best[1]:
                    best = (drafts, score)
                if m == 1 or limit >= k:
                    break
                m //= 2
                found = trie.find(tokens[len(tokens) - m :])
                assert found is not None  # a suffix of a substring the trie holds is one too
                node = found
        return best[0]

    def finished(self, request_id: str, output: Sequence[int]) -> None:
        """A request ended: its trie goes, its output joins the bounded cache of recent outputs."""
        self._mine.pop(request_id, None)
        if not output or not self.max_cached:
            return
        assert self._cache is not None
        self._recent.append(tuple(output))
        self._cache.add(output)
        while len(self._recent) > self.max_cached:
            self._cache.add(self._recent.popleft(), -1)


def proposer(cfg: SpecConfig) -> Proposer:
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    return SuffixProposer(
        cfg.suffix_decoding_max_tree_depth,
        cfg.suffix_decoding_max_cached_requests,
        cfg.suffix_decoding_max_spec_factor,
        cfg.suffix_decoding_min_token_prob,
    )


@dataclass(slots=True)
class Speculator:
    """What a ``Scheduler`` keeps for speculation: its proposer and its draft length policy."""

    config: SpecConfig
    proposer: Proposer
    policy: DraftPolicy

    @classmethod
    def of(cls, cfg: SpecConfig) -> Speculator:
        policy = DraftPolicy(
            cfg.num_speculative_tokens,
            cfg.compute_bound_tokens,
            cfg.disable_by_batch_size,
            cfg.measure_step_cost,
            cfg.adaptive_draft_length,
        )
        return cls(cfg, proposer(cfg), policy)
