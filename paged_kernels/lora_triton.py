"""The LoRA delta on CUDA: Punica's BGMV as two Triton kernels (``kernels/lora.py`` has the shapes).

``shrink``: one program per token, ``h[t] = a[slot[t]] @ x[t]`` (``max_rank`` values);
``expand``: one program per token and block of output features,
``delta[t, o] = b[slot[t], o] @ h[t] * scaling[slot[t]]``. A token of slot ``-1`` (the
base model) gets a zero delta. Accumulation in float32. Runs on CPU tensors under
``TRITON_INTERPRET=1`` for tests (``tests/kernels/test_kernels_lora.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bgmv"]


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, h_ptr, IN, R, stride_xt, stride_as, stride_ar, BLOCK_R: tl.constexpr, BLOCK_IN: tl.constexpr
):
    t = tl.program_id(0)
    s = tl.load(slot_ptr + t).to(tl.int64)
    rank = tl.where(s >= 0, R, 0)  # a base-model token reads nothing: its h is zero
    s = tl.maximum(s, 0)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_IN):
        k = k0 + tl.arange(0, BLOCK_IN)
        xv = tl.load(x_ptr + t * stride_xt + k, mask=k < IN, other=0.0).to(tl.float32)
        av = tl.load(
            a_ptr + s * stride_as + r[:, None] * stride_ar + k[None, :],
            mask=(r[:, None] < rank) & (k[None, :] < IN),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(h_ptr + t * BLOCK_R + r, acc)


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, slot_ptr, scale_ptr, out_ptr, OUT, R, stride_bs, stride_bo, stride_ot,
    BLOCK_R: tl.constexpr, BLOCK_OUT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    s = tl.load(slot_ptr + t).to(tl.int64)
    rank = tl.where(s >= 0, R, 0)  # a base-model token's delta is zero
    s = tl.maximum(s, 0)
    r = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + t * BLOCK_R + r)
    bv = tl.load(
        b_ptr + s * stride_bs + o[:, None] * stride_bo + r[None, :],
        mask=(o[:, None] < OUT) & (r[None, :] < rank),
        other=0.0,
    ).to(tl.float32)
    scale = tl.load(scale_ptr + s).to(tl.float32)
    y = tl.sum(bv * h[None, :], axis=1) * scale
    tl.store(out_ptr + t * stride_ot + o, y.to(out_ptr.dtype.element_ty), mask=o < OUT)


def bgmv(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """The delta ``[T, out]`` (``x``'s dtype) of every token: ``x`` ``[T, in]``, ``a`` ``[S, R, in]``,
    ``b`` ``[S, out, R]``, ``scaling`` ``[S]``, ``token_slots`` ``[T]`` (``-1``: no delta)."""
    x = x.contiguous()
    tokens, width = x.shape
    rank, out_features = a.shape[1], b.shape[1]
    if a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("a and b must be contiguous in their last dimension")
    block_r = max(16, triton.next_power_of_2(rank))
    h = torch.empty(tokens, block_r, dtype=torch.float32, device=x.device)
    out = torch.empty(tokens, out_features, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    _shrink_kernel[(tokens,)](
        x, a, token_slots, h, width, rank, x.stride(0), a.stride(0), a.stride(1), BLOCK_R=block_r, BLOCK_IN=64
    )
    block_out = 64
    _expand_kernel[(tokens, triton.cdiv(out_features, block_out))](
        h, b, token_slots, scaling, out, out_features, rank, b.stride(0), b.stride(1), out.stride(0),
        BLOCK_R=block_r, BLOCK_OUT=block_out,
    )  # fmt: skip
    return out
