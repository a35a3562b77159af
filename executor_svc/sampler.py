"""Token sampling: greedy, temperature, top-k, top-p, reproducible per request.

A seeded request draws its noise from a generator seeded with
``(seed, num_generated)``, so the token at a given output position does not
depend on what else ran in the batch or on whether the request was preempted
and recomputed in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive positions apart
_MASK64 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf.

    Only the candidates that can survive are sorted: with every row's top-k bounded,
    ``topk`` of the largest k instead of a sort of the whole vocabulary (on CPU a sort of
    49,152 logits per row cost as much as the forward pass at batch 64). The result is the
    same, since top-p applies to what top-k kept.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    if bool((k == vocab).all()) and bool((top_p >= 1.0).all()):
        return logits  # no row filters anything
    width = int(k.max())
    if width < vocab:
        sorted_logits, order = logits.topk(width, dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(width, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token if the mass strictly before it is below top_p (the first is always kept).
    before = probs.cumsum(dim=-1) - probs
    # top_p = 1 keeps everything, even where rounding makes the cumulative mass reach 1.
    drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    """One token per row of ``logits`` ``[S, vocab]``."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sel = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        top_k = torch.tensor([params[i].top_k for i in rows], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device)
        probs = _filter(logits[sel] / temps[:, None], top_k, top_p).softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            gen = None
            if params[i].seed is not None:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed((params[i].seed * _MIX + num_generated[i]) & _MASK64)
            noise[j].exponential_(generator=gen)
        tokens[sel] = (probs / noise).argmax(dim=-1)
    return tokens.tolist()
