"""vLLM's token masks on the raw logits: ``allowed_token_ids`` and ``bad_words``.

``allowed_token_ids``: every other token of the row is masked (-inf). ``bad_words``
(token sequences, tokenized by the scheduler as vLLM does: each word with and
without a leading space): a sequence's last token is masked when the row's output
so far ends with the tokens before it; a one-token word is always masked. Only
output tokens count, as in vLLM (a prompt that ends with a word's prefix does not
mask its last token). Both apply under greedy and sampling, before ``logit_bias``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from executor_svc.sampler import Sampling


def banned(words: Sequence[Sequence[int]], outputs: Sequence[int]) -> set[int]:
    """The tokens ``words`` forbid after ``outputs`` (the row's output tokens so far)."""
    out = set()
    for w in words:
        prefix = len(w) - 1
        if prefix > len(outputs):
            continue
        if prefix == 0 or list(outputs[len(outputs) - prefix :]) == list(w[:prefix]):
            out.add(w[-1])
    return out


def _outputs(history: Sequence[int] | None, num_generated: int) -> Sequence[int]:
    """A row's output tokens: the last ``num_generated`` of its history (prompt + outputs)."""
    if history is None or num_generated == 0:
        return ()
    return history[max(0, len(history) - num_generated) :]


def apply(
    logits: torch.Tensor,
    params: Sequence[Sampling],
    num_generated: Sequence[int],
    histories: Sequence[Sequence[int] | None] | None,
) -> None:
    """Mask, in place, what each row's ``allowed_token_ids`` and ``bad_words`` exclude."""
    dev = logits.device
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if allowed:
        keep = torch.zeros(len(allowed), logits.shape[-1], dtype=torch.bool, device=dev)
        rows = [j for j, i in enumerate(allowed) for _ in params[i].allowed_token_ids]
        cols = [t for i in allowed for t in params[i].allowed_token_ids]
        keep[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = True
        sel = torch.tensor(allowed, device=dev)
        logits[sel] = logits[sel].masked_fill(~keep, float("-inf"))
    rows, cols = [], []
    for i, p in enumerate(params):
        if p.bad_words:
            history = histories[i] if histories is not None else None
            for t in sorted(banned(p.bad_words, _outputs(history, num_generated[i]))):
                rows.append(i)
                cols.append(t)
    if rows:
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
