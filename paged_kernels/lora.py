"""LoRA deltas for a batch that mixes adapters: Punica's shapes, the torch path.

Every targeted linear layer holds its adapters stacked in slots: ``a`` is
``[slots, max_rank, in]`` and ``b`` is ``[slots, out, max_rank]`` (a lower rank is
zero-padded). Each token names the slot of its sequence's adapter (``-1``: the base
model, no delta). The delta of token ``t`` on slot ``s`` of rank ``r`` is
``x[t] @ a[s, :r].T @ b[s, :, :r].T * scaling[s]``, PEFT's ``lora_B(lora_A(x)) * scaling``.

On CPU the tokens of one slot are gathered and run as two GEMMs (SGMV: one segment
per adapter), at the adapter's own rank, in PEFT's order of operations, so a
sequence's output is what PEFT computes for it. On CUDA the Triton kernel
(``paged_kernels/lora_triton.py``) runs per token (BGMV) over the padded rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Segment:
    """The tokens of one slot in a step: their rows in the packed batch."""

    slot: int
    rows: torch.Tensor  # int64 [n]
    rank: int
    scaling: float


def segments(token_slots: list[int], ranks: list[int], scalings: list[float]) -> list[Segment]:
    """One segment per slot the step uses, in slot order (built once per step, used by every layer)."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    return [
        Segment(s, torch.tensor(rows, dtype=torch.long), ranks[s], scalings[s]) for s, rows in sorted(by_slot.items())
    ]


def sgmv_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segs: list[Segment]) -> None:
    """``out[rows] += x[rows] @ a[s,:r].T @ b[s,:,:r].T * scaling`` per segment (in place).

    ``x``: ``[T, in]``; ``out``: ``[T, out]``, the base layer's output."""
    for seg in segs:
        xs = x.index_select(0, seg.rows)
        delta = (xs @ a[seg.slot, : seg.rank].T) @ b[seg.slot, :, : seg.rank].T * seg.scaling
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


@dataclass(frozen=True, slots=True)
class Gather:
    """A step's adapter tokens for the batched-gather path: their rows, slots and scalings."""

    rows: torch.Tensor  # int64 [n]: rows of the packed batch on an adapter
    slots: torch.Tensor  # int64 [n]: each one's slot
    scaling: torch.Tensor  # [n, 1]: each one's slot's scaling


def gather_of(token_slots: list[int], scalings: list[float], dtype: torch.dtype) -> Gather:
    rows = [t for t, s in enumerate(token_slots) if s >= 0]
    slots = [token_slots[t] for t in rows]
    return Gather(
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(slots, dtype=torch.long),
        torch.tensor([scalings[s] for s in slots], dtype=dtype)[:, None],
    )


def bgmv_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, g: Gather) -> None:
    """BGMV: every adapter token at once over the padded rank, each gathering its slot's A and B
    (``[n, max_rank, in]``, ``[n, out, max_rank]``): one chain of ops per layer however many
    adapters the step mixes, for steps of a few tokens (decodes), where SGMV would run a
    chain per adapter. Zero padding adds exact zeros."""
    xs = x.index_select(0, g.rows)
    h = torch.bmm(a.index_select(0, g.slots), xs.unsqueeze(2))
    delta = torch.bmm(b.index_select(0, g.slots), h).squeeze(2) * g.scaling
    out.index_add_(0, g.rows, delta)
