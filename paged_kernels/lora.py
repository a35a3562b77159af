"""LoRA deltas for a batch that mixes adapters: Punica's shapes, the torch path.

Every targeted linear layer holds its adapters stacked in slots: ``a`` is
``[slots, max_rank, in]`` and ``b`` is ``[slots, out, max_rank]`` (a lower rank is
zero-padded). Each token names the slot of its sequence's adapter (``-1``: the base
model, no delta). The delta of token ``t`` on slot ``s`` of rank ``r`` is
``x[t] @ a[s, :r].T @ b[s, :, :r].T * scaling[s]``, PEFT's ``lora_B(lora_A(x)) * scaling``.

On CPU two shapes of step, two paths:
- a prefill, or a step whose tokens are all on one adapter: per adapter, its tokens (all
  of them: no gather) as two GEMMs at the adapter's own rank, in PEFT's order of operations
  (SGMV: one segment per adapter);
- a decode-sized step mixing adapters (or an adapter and the base model): every slot at
  once (``stacked_add``): one GEMM computes each token's product with every slot's A
  (``[T, slots * max_rank]``: a few dozen columns), a mask keeps its own slot's columns
  times its scaling (zero for the base model and for padding), and one GEMM expands it
  through every slot's B. Three ops per layer however many adapters, and no per-token
  copies of the weights (gathering each token's A and B moved more bytes per layer than
  the layer's own weights).
On CUDA the Triton kernel (``paged_kernels/lora_triton.py``) runs per token (BGMV) over
the padded rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Segment:
    """The tokens of one slot in a step: their rows in the packed batch (None: every row)."""

    slot: int
    rows: torch.Tensor | None  # int64 [n]
    rank: int
    scaling: float


def segments(token_slots: list[int], ranks: list[int], scalings: list[float]) -> list[Segment]:
    """One segment per slot the step uses, in slot order (built once per step, used by every layer)."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    return [
        Segment(
            s, None if len(rows) == len(token_slots) else torch.tensor(rows, dtype=torch.long), ranks[s], scalings[s]
        )
        for s, rows in sorted(by_slot.items())
    ]


def sgmv_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segs: list[Segment]) -> None:
    """``out[rows] += x[rows] @ a[s,:r].T @ b[s,:,:r].T * scaling`` per segment (in place).

    ``x``: ``[T, in]``; ``out``: ``[T, out]``, the base layer's output."""
    for seg in segs:
        xs = x if seg.rows is None else x.index_select(0, seg.rows)
        delta = (xs @ a[seg.slot, : seg.rank].T) @ b[seg.slot, :, : seg.rank].T * seg.scaling
        if seg.rows is None:
            out.add_(delta)
        else:
            out.index_add_(0, seg.rows, delta)


def bgmv_loop(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """The definition, one token at a time over the padded rank: what the fast paths are tested against."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        if s >= 0:
            out[t] = (b[s].float() @ (a[s].float() @ x[t].float())) * float(scaling[s])
    return out


def stack_mask(
    token_slots: list[int], ranks: list[int], scalings: list[float], max_rank: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[T, slots * max_rank]``: token ``t`` on slot ``s`` of rank ``r`` has ``scaling[s]`` in columns
    ``s * max_rank`` to ``s * max_rank + r`` and 0 elsewhere; a base-model token is all 0."""
    mask = torch.zeros(len(token_slots), len(ranks) * max_rank, dtype=dtype)
    for t, s in enumerate(token_slots):
        if s >= 0:
            mask[t, s * max_rank : s * max_rank + ranks[s]] = scalings[s]
    return mask


def stacked(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot's A stacked, transposed, ``[in, slots * max_rank]``, and every slot's B side by side,
    transposed, ``[slots * max_rank, out]``: views, no copy, when ``b``'s storage is ``[out, slots, max_rank]``
    (the executor's, made once per layer); a copy otherwise."""
    slots, rank, width = a.shape
    return a.view(slots * rank, width).T, b.permute(1, 0, 2).reshape(b.shape[1], slots * rank).T


def stacked_add(out: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, mask: torch.Tensor) -> None:
    """``out += ((x @ a_t) * mask) @ b_t`` in place (``a_t``, ``b_t``: ``stacked``; ``mask``: ``stack_mask``).
    A masked column adds exact zeros, so a base-model token's output is untouched."""
    h = torch.mm(x, a_t)
    h.mul_(mask)
    out.addmm_(h, b_t)
