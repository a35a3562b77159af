"""Prefill executors and decode executors (``executor_svc --role``): which requests are disaggregated.

A long prompt's prefill chunks share steps with running decodes on a mixed
executor, so every decode's inter-token latency rises while it is prefilled.
With executors of role ``prefill`` and ``decode`` in a namespace, a request is
**disaggregated** when its uncached prompt (its tokens less the longest prefix
any decode-capable pool caches) exceeds ``--disagg-min-prompt-tokens``, and
some prefill executor has fewer than ``--disagg-max-prefill-queue`` requests
(Dynamo's conditional disaggregation: remote prefill only for long prompts
while the prefill queue is short; llm-d's ``nonCachedTokens``). Then:

1. placement gives it to a prefill executor (the least loaded one with room);
2. that executor's loop picks the decode executor with the most room (its
   ``handoff``) and computes the prompt in chunks; after each reported chunk
   it lends the newly full blocks and offers them to the decode executor, the
   first offer asking it to **reserve** room for the whole prompt
   (core/transfers.py ``Transfers.precopy``; core/prefetch.py), which then
   pulls them into its cache while the prompt is still being computed;
3. the prefill executor samples the first token (streamed from there), then
   makes one short stop: the rest of the KV is lent and the request requeued
   for the decode executor (``KvSource.to``), which pulls what is left and
   decodes.

Every other request runs mixed, as before, on decode and mixed executors;
prefill executors take only disaggregated requests (unless no decode-capable
executor serves at all). A move's usual failure handling applies: a dead
prefill executor's requests are recomputed, a dead decode executor's offers
and reservations end and the handoff goes to any decode executor. This module
only decides; it is pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # placement asks this module; this one only reads their fields
    from scheduler_svc.core.placement import Candidate, PoolView

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """``--disagg-min-prompt-tokens`` (0: never disaggregate) and ``--disagg-max-prefill-queue`` (requests a
    prefill executor may hold before long prompts run mixed again)."""

    min_prompt_tokens: int = 0
    max_prefill_queue: int = 4

    def __post_init__(self) -> None:
        if self.min_prompt_tokens < 0 or self.max_prefill_queue < 1:
            raise ValueError("disagg: min_prompt_tokens must be >= 0 and max_prefill_queue >= 1")

    @property
    def on(self) -> bool:
        return self.min_prompt_tokens > 0


def split(c: Candidate, pools: Iterable[tuple[PoolView, int]], cfg: DisaggConfig) -> bool:
    """Whether ``c`` runs disaggregated: ``pools`` are the serving pools with the requests each runs (or
    took on paper in this walk). Never a request that moves with its KV or has output already (its prompt
    was computed once: a requeue recomputes where it lands)."""
    if not cfg.on or c.target or c.num_tokens > c.prompt_len:
        return False
    pools = list(pools)
    prefill = [v for v, running in pools if v.role == PREFILL and running < cfg.max_prefill_queue and c.fits_ever(v)]
    decode = [v for v, _ in pools if v.role != PREFILL and c.fits_ever(v)]
    if not prefill or not decode:
        return False
    cached = max(c.cached_tokens(v.executor, v.block_size) for v in decode)
    return c.num_tokens - cached > cfg.min_prompt_tokens


def takes(role: str, disaggregated: bool, decode_serving: bool) -> bool:
    """Whether a pool of ``role`` may take a request: a disaggregated one only a prefill pool; any other
    one every pool but a prefill pool, unless no decode-capable pool serves (then prefill pools run it
    mixed rather than leave it waiting)."""
    if disaggregated:
        return role == PREFILL
    return role != PREFILL or not decode_serving


def handoff(views: dict[str, PoolView], me: str, need: int) -> str:
    """The decode-capable pool a prefill executor hands a request to: the one with the most free device
    blocks above its watermark that holds ``need`` blocks and a seat ('' if none)."""
    able = [
        v
        for e, v in views.items()
        if e != me
        and v.serving
        and v.role != PREFILL
        and v.running < v.max_num_seqs
        and v.free[0] - v.watermark >= need
    ]
    return max(able, key=lambda v: (v.free[0] - v.watermark, v.executor)).executor if able else ""
