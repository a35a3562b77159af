"""Parallel-sampling groups (``SamplingParams.n``): which completions of one request move together.

A group's mates share a prompt. The scheduler admits, preempts and resumes them together: one mate
computes the prompt while the others wait in ``running``, holding nothing, with ``source`` set to it,
then fork from it (``Scheduler._fork``). These functions only read requests (``relink`` sets
``source``); the scheduler applies what they say to its blocks and records.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_svc.core.fit import blocks_for
from scheduler_svc.core.request import Request


def mates_running(running: Iterable[Request], req: Request) -> list[Request]:
    """``req`` and its running group mates, in index order (a request alone: just it)."""
    if not req.group:
        return [req]
    return sorted((r for r in running if r.group == req.group), key=lambda r: r.index)


def mates_waiting(waiting: Iterable[Request], head: Request) -> list[Request]:
    """The waiting group mates ``head`` can bring along: same prompt, holding nothing, and not one
    that wants its own prompt logprobs (it computes its prompt itself)."""
    if not head.group:
        return []
    return [
        r
        for r in waiting
        if r is not head
        and r.group == head.group
        and not r.blocks
        and len(r.prompt_ids) == len(head.prompt_ids)
        and (r.params.prompt_logprobs is None or r.output_ids)
    ]


def fork_need(head: Request, mates: list[Request], block_size: int) -> int:
    """Device blocks the ``mates`` of ``head`` take beyond the full prompt blocks they share with it."""
    shared = (len(head.prompt_ids) - 1) // block_size
    return sum(blocks_for(m.num_tokens, block_size) - shared for m in mates)


def waiting_on(running: Iterable[Request], src: Request) -> list[Request]:
    """The mates still waiting to fork from ``src``, in admission order."""
    return [r for r in running if r.source is src]


def relink(running: list[Request]) -> None:
    """After a reload: a running mate holding nothing waits again to fork from a mate that holds
    the prompt (with none, it computes its prompt itself)."""
    for r in running:
        if r.group and not r.blocks and r.source is None:
            r.source = next((o for o in running if o.group == r.group and o.blocks and o.source is None), None)
