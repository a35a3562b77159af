"""Speculative decoding, the executor's side: exact verification of drafted tokens.

A row with ``d`` drafts runs its last token and the drafts in the step's forward, and keeps the
logits of all ``1 + d`` positions. Position ``j`` is sampled exactly as a plain step at that
position would sample it, given the drafts before it as the request's tokens: the same logits
processors (token masks, bias, min_tokens, penalties over the history up to there, the grammar's
mask after the drafts before it), the same temperature and filters, and the same seeded draw,
which is a function of (seed, output position) only (``sampler.row_key``; ``_draw_whole``; the same ``race``).
Drafts are accepted while the sampled token equals them; the first token that differs (or the
token after the last draft) is the row's next token and ends the row.

So every token a row yields is the token a step-by-step run would have sampled there: greedy rows
take the longest prefix of drafts that matches the argmax, and for the drafts of n-gram and suffix
proposals (point masses) this is rejection sampling with acceptance probability p(draft), which
leaves the output distribution unchanged; a seeded request yields identical tokens with
speculation on or off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from executor_svc.sampler import Sampling, sample
from paged_kernels.cpu_race import Draw


def accept(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a row yields: ``sampled[j]`` while it equals ``drafts[j]``, then the first that
    differs (or ``sampled[len(drafts)]``, the token after the last draft)."""
    out: list[int] = []
    for j, t in enumerate(sampled):
        out.append(t)
        if j >= len(drafts) or t != drafts[j]:
            break
    return out


def expand(
    params: Sequence[Sampling],
    num_generated: Sequence[int],
    histories: Sequence[Sequence[int] | None] | None,
    widths: Sequence[int],
) -> tuple[list[Sampling], list[int], list[Sequence[int] | None] | None]:
    """Per-position sampling inputs for rows of ``widths`` positions: position ``j`` of a row has
    ``j`` more output tokens (its drafts) and its history cut after them. A row's history holds its
    drafts (the executor records every token it runs)."""
    ps: list[Sampling] = []
    gens: list[int] = []
    hists: list[Sequence[int] | None] | None = [] if histories is not None else None
    for i, w in enumerate(widths):
        h = histories[i] if histories is not None else None
        for j in range(w):
            ps.append(params[i])
            gens.append(num_generated[i] + j)
            if hists is not None:
                hists.append(None if h is None else h[: len(h) - (w - 1) + j])
    return ps, gens, hists


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[Sampling],
    num_generated: Sequence[int],
    histories: Sequence[Sequence[int] | None] | None,
    drafts: Sequence[Sequence[int]],
    race: Draw | None = None,
) -> list[list[int]]:
    """Each row's sampled tokens at its ``1 + len(drafts[i])`` positions (``logits``: those positions'
    rows, grammar masks applied), in one batched ``sample`` (``race``: as ``sample``'s)."""
    widths = [1 + len(d) for d in drafts]
    ps, gens, hists = expand(params, num_generated, histories, widths)
    chosen = sample(logits, ps, gens, hists, race)
    out, at = [], 0
    for w in widths:
        out.append(chosen[at : at + w])
        at += w
    return out
