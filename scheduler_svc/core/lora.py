"""Per-step LoRA admission: at most ``max_loras`` distinct adapters run at once (``--max-loras``).

The executor holds that many adapters in its device slots, and a step may use only those; so
the scheduler keeps the running set within the limit. A waiting request whose adapter would
exceed it waits at the head of the queue like one that does not fit (FCFS: it goes first once
a running adapter's requests are done, so it never starves); requests on the base model and
on adapters already running are not held back by the limit itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_svc.core.request import Request


def adapters_of(reqs: Iterable[Request]) -> set[str]:
    """The distinct adapters (by digest: two names for the same weights share a slot) among ``reqs``."""
    return {r.lora.digest for r in reqs if r.lora is not None}


def admits(running: Iterable[Request], req: Request, max_loras: int) -> bool:
    """Whether ``req`` may join ``running`` under ``max_loras`` (0: no adapters are limited)."""
    if req.lora is None or max_loras <= 0:
        return True
    held = adapters_of(running)
    return req.lora.digest in held or len(held) < max_loras
