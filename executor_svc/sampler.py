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
    """Mask logits outside each row's top-k and top-p nucleus with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
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
