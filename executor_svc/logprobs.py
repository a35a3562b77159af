"""Log-probabilities of chosen tokens and their top alternatives, for a batch of rows.

As vLLM returns them by default: ``log_softmax`` of the model's raw logits, before
logit_bias, penalties, temperature or any filter. One pass for all rows that want
them (sampled tokens and prompt positions alike); ``k`` varies per row, the top-k is
taken once at the largest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Entry:
    token_id: int
    logprob: float
    rank: int  # 1 + how many tokens were more likely
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def gather(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[Entry]:
    """For each row of ``logits`` ``[N, vocab]``: the logprob and rank of ``targets[i]`` and
    the ``ks[i]`` most likely tokens. Targets must be inside the vocabulary (the engine
    refuses plans that name others)."""
    if not targets:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(targets, device=lp.device)[:, None]
    chosen = lp.gather(1, tgt)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen_lp: list[float] = chosen[:, 0].tolist()
    k = max(ks)
    top_t, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    top_lp, top_ids = top_t.tolist(), top_i.tolist()
    return [
        Entry(t, chosen_lp[i], ranks[i], tuple(top_ids[i][: ks[i]]), tuple(top_lp[i][: ks[i]]))
        for i, t in enumerate(targets)
    ]
