"""Triton kernels for the paged-KV operations, same API as ``kernels.reference``.

``paged_attention`` runs one of two paths:

- the *unified* kernel (:func:`unified_attention`) handles any packed batch of
  prefill chunks and decode tokens in one launch. A program owns a tile of up
  to ``BLOCK_Q`` query tokens of one sequence and all the query heads that
  share one KV head (GQA packing: every K/V tile read from memory serves
  ``H / KVH`` heads). It walks the sequence's context through its block table
  with an online softmax.
- the *split-KV* path (:func:`split_kv_attention`, flash-decoding) for
  decode-only batches with long contexts: there the unified kernel would start
  only ``S * KVH`` programs, each streaming a whole context, which leaves most
  of a large GPU idle. Splitting every context into slices gives more, shorter
  programs; a second kernel merges their partial ``(max, sum, acc)`` triples.

Everything that depends on the batch is read from ``PagedMetadata`` tensors
inside the kernels (sequence lookup, lengths), so no host-device sync happens
per call. The path choice only looks at tensor shapes.

All kernels also run on CPU tensors under ``TRITON_INTERPRET=1`` for tests.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from paged_kernels.reference import PagedMetadata

__all__ = [
    "copy_blocks",
    "num_kv_splits",
    "paged_attention",
    "reshape_and_cache",
    "split_kv_attention",
    "unified_attention",
]

# Triton decides at decoration time whether ``@triton.jit`` compiles or
# interprets, so reading the flag once at import matches the kernels below.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

_LOG2E = 1.4426950408889634

# Split-KV path tuning. Contexts shorter than this gain nothing from splitting.
SPLIT_KV_MIN_CONTEXT = 512
# A slice shorter than this spends more on its partial result than on keys.
SPLIT_KV_MIN_KEYS_PER_SPLIT = 256
MAX_KV_SPLITS = 16
# Aim for this many programs per streaming multiprocessor on decode batches.
SPLIT_KV_PROGRAMS_PER_SM = 4


# --------------------------------------------------------------------------
# Attention building blocks
# --------------------------------------------------------------------------


@triton.jit
def _find_sequence(query_start_loc, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning global query-tile ``q_block`` (binary search).

    Sequence ``s`` owns tiles ``[qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1)``.
    That numbering over-counts by at most one tile per sequence (those
    programs exit at once) but needs no prefix sum over tile counts, so the
    grid size ``T // BLOCK_Q + S`` is known from shapes alone.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first_tile <= q_block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    key_cache,
    value_cache,
    block_table_row,
    kv_head,
    tile_start,
    num_keys,
    q_pos,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys ``[tile_start, tile_start + TILE_N)``.

    Keys are gathered per position through the block table, so ``TILE_N`` and
    the cache block size are independent (any power-of-two block size works).
    Scores are kept in log2 units (``qk_scale`` includes log2(e)) for exp2.
    Row ``m`` may see key ``n`` iff ``n <= q_pos[m]`` and ``n < num_keys``.
    """
    offs_n = tile_start + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    key_ok = offs_n < num_keys
    dim_ok = offs_d < HEAD_DIM
    block = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE

    k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
    k = tl.load(
        key_cache + k_off[None, :] + offs_d[:, None] * stride_kd,
        mask=key_ok[None, :] & dim_ok[:, None],
        other=0.0,
    )
    v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
    v = tl.load(
        value_cache + v_off[:, None] + offs_d[None, :] * stride_vd,
        mask=key_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
    allowed = (offs_n[None, :] <= q_pos[:, None]) & key_ok[None, :]
    s = tl.where(allowed, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have seen no key yet keep m = -inf; subtracting 0 instead of
    # -inf keeps their p and alpha at 0 rather than NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _unified_attention_kernel(
    out,
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    num_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    QPK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(T // BLOCK_Q + S, KVH)``; one program per (query tile, KV head).

    ``BLOCK_M = BLOCK_Q * QPK_PAD`` rows: row ``m`` is query token
    ``m // QPK_PAD`` of the tile and query head
    ``kv_head * QUERIES_PER_KV + m % QPK_PAD``.
    """
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_sequence(query_start_loc, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    tile_in_seq = q_block - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_idx = tile_in_seq * BLOCK_Q + offs_m // QPK_PAD
    head = kv_head * QUERIES_PER_KV + offs_m % QPK_PAD
    row_ok = (q_idx < q_len) & (offs_m % QPK_PAD < QUERIES_PER_KV)
    dim_ok = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)

    q = tl.load(
        query + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = context_len + q_idx
    # Causality: the last query row of this tile bounds the keys to read.
    num_keys = context_len + tl.minimum((tile_in_seq + 1) * BLOCK_Q, q_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    block_table_row = block_tables + seq.to(tl.int64) * stride_bt
    for tile_start in range(0, num_keys, TILE_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, key_cache, value_cache, block_table_row, kv_head, tile_start, num_keys, q_pos,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, qk_scale,
            HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        acc.to(out.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _split_kv_kernel(
    part_acc,
    part_max,
    part_sum,
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(S, KVH, NUM_SPLITS)``: one decode token, one KV head, one slice.

    Each sequence cuts its own context into ``NUM_SPLITS`` slices of whole
    tiles, so no batch-wide maximum length is needed. The unnormalised
    accumulator, running max and running sum go to ``part_*`` laid out
    ``[S, H, NUM_SPLITS(, D)]``; an empty slice leaves ``(-inf, 0, 0)``.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    token = tl.load(query_start_loc + seq).to(tl.int64)
    seq_len = tl.load(seq_lens + seq)
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    split_start = split * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    head = kv_head * QUERIES_PER_KV + offs_m
    row_ok = offs_m < QUERIES_PER_KV
    dim_ok = offs_d < HEAD_DIM
    q = tl.load(
        query + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    # A decode token is the last position: it sees every key of its context.
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    block_table_row = block_tables + seq.to(tl.int64) * stride_bt
    for tile_start in range(split_start, split_end, TILE_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, key_cache, value_cache, block_table_row, kv_head, tile_start, split_end, q_pos,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, qk_scale,
            HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip

    row = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + split
    tl.store(part_max + row, m_i, mask=row_ok)
    tl.store(part_sum + row, l_i, mask=row_ok)
    tl.store(
        part_acc + row[:, None] * HEAD_DIM + offs_d[None, :],
        acc,
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _split_kv_reduce_kernel(
    out,
    part_acc,
    part_max,
    part_sum,
    query_start_loc,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """Grid ``(S, H)``: merge the slices of one (sequence, head).

    With global max ``M``, slice ``i`` is weighted by ``2^(m_i - M)``; the
    result is ``sum(w_i * acc_i) / sum(w_i * l_i)``. Empty slices (``m_i``
    = -inf) get weight 0; slice 0 is never empty, so ``M`` is finite.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    split_ok = offs_s < NUM_SPLITS
    dim_ok = offs_d < HEAD_DIM
    row = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + offs_s

    m = tl.load(part_max + row, mask=split_ok, other=float("-inf"))
    lsum = tl.load(part_sum + row, mask=split_ok, other=0.0)
    acc_mask = split_ok[:, None] & dim_ok[None, :]
    acc = tl.load(part_acc + row[:, None] * HEAD_DIM + offs_d[None, :], mask=acc_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    total = tl.sum(w * lsum, axis=0)
    merged = tl.sum(w[:, None] * acc, axis=0) / total

    token = tl.load(query_start_loc + seq).to(tl.int64)
    out_ptrs = out + token * stride_ot + head * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, merged.to(out.dtype.element_ty), mask=dim_ok)


# --------------------------------------------------------------------------
# Attention launchers
# --------------------------------------------------------------------------


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))


def _dot_config(query: torch.Tensor, key_cache: torch.Tensor) -> tuple[tl.dtype, str]:
    """Operand dtype and precision of ``tl.dot`` (accumulation is always fp32).

    16-bit caches feed tensor cores in their own dtype (the query and the
    softmax weights are cast to it, as in FlashAttention). fp32 caches use
    exact fp32 products ("ieee", not TF32), as does an fp32 query over a
    16-bit cache (the reference upcasts the cache then). The interpreter
    gets bf16 ``tl.dot`` wrong (garbage results), so it always gets fp32.
    """
    if _INTERPRETING or torch.float32 in (query.dtype, key_cache.dtype):
        return tl.float32, "ieee"
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[key_cache.dtype], "tf32"


def _default_block_m(decode_only: bool, query: torch.Tensor, key_cache: torch.Tensor) -> int:
    """Query rows per program of the unified kernel.

    Decode-only: 16, the smallest ``tl.dot`` tile (one token per sequence, so
    more rows would be padding). Otherwise 64 rows amortise each K/V tile over
    more queries; with fp32 operands (no tensor cores) 32, as 64 x 128 fp32
    tiles spill registers on sm_90 (ptxas: ~7 KB of stack per thread).
    """
    if decode_only:
        return 16
    return 32 if torch.float32 in (query.dtype, key_cache.dtype) else 64


def _check_shapes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: PagedMetadata) -> None:
    heads, dim = query.shape[1:]
    kv_heads = key_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    if key_cache.shape[1] != meta.block_size or value_cache.shape != key_cache.shape or key_cache.shape[3] != dim:
        raise ValueError(f"cache shape {tuple(key_cache.shape)} does not fit query {tuple(query.shape)} / block size")
    if meta.block_size & (meta.block_size - 1):
        raise ValueError(f"block size must be a power of two, got {meta.block_size}")
    for name in ("block_tables", "query_start_loc", "seq_lens"):
        if getattr(meta, name).device != query.device:
            raise ValueError(f"meta.{name} is on {getattr(meta, name).device}, the query on {query.device}")


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    block_m: int | None = None,
    tile_n: int = 32,
) -> torch.Tensor:
    """Paged attention for any mix of prefill chunks and decode tokens.

    ``block_m`` rows per program = query tokens x padded query heads per KV
    head (default: :func:`_default_block_m`); ``tile_n`` keys per step.
    """
    _check_shapes(query, key_cache, value_cache, meta)
    num_tokens, heads, dim = query.shape
    out = torch.empty_like(query)
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    kv_heads = key_cache.shape[2]
    qpk = heads // kv_heads
    qpk_pad = _pow2(qpk)
    if block_m is None:
        block_m = _default_block_m(num_tokens == num_seqs, query, key_cache)
    block_m = max(block_m, qpk_pad, 16)
    block_q = block_m // qpk_pad
    dot_dtype, precision = _dot_config(query, key_cache)
    grid = (num_tokens // block_q + num_seqs, kv_heads)
    _unified_attention_kernel[grid](
        out, query, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        num_seqs, scale * _LOG2E,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), meta.block_tables.stride(0),
        QUERIES_PER_KV=qpk, QPK_PAD=qpk_pad, HEAD_DIM=dim, HEAD_PAD=_pow2(dim, 16),
        BLOCK_SIZE=meta.block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
    )  # fmt: skip
    return out


def split_kv_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    num_splits: int,
    tile_n: int = 32,
) -> torch.Tensor:
    """Flash-decoding for decode-only batches (every sequence has q_len 1)."""
    _check_shapes(query, key_cache, value_cache, meta)
    num_tokens, heads, dim = query.shape
    num_seqs = meta.num_seqs
    if num_tokens != num_seqs:
        raise ValueError(f"split-KV attention needs one query token per sequence, got {num_tokens} for {num_seqs}")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    kv_heads = key_cache.shape[2]
    qpk = heads // kv_heads
    head_pad = _pow2(dim, 16)
    dot_dtype, precision = _dot_config(query, key_cache)
    part_acc = torch.empty(num_seqs, heads, num_splits, dim, dtype=torch.float32, device=query.device)
    part_max = torch.empty(num_seqs, heads, num_splits, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    _split_kv_kernel[(num_seqs, kv_heads, num_splits)](
        part_acc, part_max, part_sum, query, key_cache, value_cache,
        meta.block_tables, meta.query_start_loc, meta.seq_lens, scale * _LOG2E,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), meta.block_tables.stride(0),
        NUM_HEADS=heads, NUM_SPLITS=num_splits, QUERIES_PER_KV=qpk, HEAD_DIM=dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=meta.block_size, BLOCK_M=_pow2(qpk, 16), TILE_N=tile_n,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
    )  # fmt: skip
    _split_kv_reduce_kernel[(num_seqs, heads)](
        out, part_acc, part_max, part_sum, meta.query_start_loc, *out.stride(),
        NUM_HEADS=heads, NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits),
        HEAD_DIM=dim, HEAD_PAD=head_pad,
    )  # fmt: skip
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small stand-in off CUDA."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def num_kv_splits(num_tokens: int, meta: PagedMetadata, num_kv_heads: int, device: torch.device) -> int:
    """How many context slices per sequence; 1 means the unified kernel.

    Split only decode-only batches (``T == S``: every scheduled sequence has at
    least one new token) whose block tables can hold long contexts, and only
    as far as needed to give each SM ``SPLIT_KV_PROGRAMS_PER_SM`` programs.
    The block-table width stands in for the longest context so that the
    choice needs no device-to-host read of ``seq_lens``.
    """
    if num_tokens != meta.num_seqs or num_tokens == 0:
        return 1
    capacity = meta.block_tables.shape[1] * meta.block_size
    if capacity < SPLIT_KV_MIN_CONTEXT:
        return 1
    wanted = math.ceil(SPLIT_KV_PROGRAMS_PER_SM * _num_sms(device) / (meta.num_seqs * num_kv_heads))
    return max(1, min(wanted, MAX_KV_SPLITS, capacity // SPLIT_KV_MIN_KEYS_PER_SPLIT))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context."""
    splits = num_kv_splits(query.shape[0], meta, key_cache.shape[2], query.device)
    if splits > 1:
        return split_kv_attention(query, key_cache, value_cache, meta, scale, splits)
    return unified_attention(query, key_cache, value_cache, meta, scale)


# --------------------------------------------------------------------------
# Cache writes and block copies
# --------------------------------------------------------------------------


@triton.jit
def _reshape_and_cache_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Grid ``(T,)``: write token ``t``'s K and V (all KV heads) to its slot.

    K/V already have the cache dtype; the kernel only moves them.
    """
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(key + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    k_dst = key_cache + block * stride_kcb + in_block * stride_kcs
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd, k, mask=mask)
    v = tl.load(value + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    v_dst = value_cache + block * stride_vcb + in_block * stride_vcs
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V ``[T, KVH, D]`` into the cache slots; slots < 0 are skipped."""
    num_tokens, kv_heads, dim = key.shape
    if num_tokens == 0:
        return
    # A cast in the kernel would be free on GPU, but the interpreter truncates
    # fp32 -> bf16 where torch and the GPU round to nearest even. Casting here
    # keeps every backend bit-identical; model and cache dtypes normally match.
    key = key.to(key_cache.dtype)
    value = value.to(value_cache.dtype)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        KV_HEADS=kv_heads, HEADS_PAD=_pow2(kv_heads), HEAD_DIM=dim, HEAD_PAD=_pow2(dim),
        BLOCK_SIZE=key_cache.shape[1],
    )  # fmt: skip


@triton.jit
def _copy_blocks_kernel(
    src,
    dst,
    src_blocks,
    dst_blocks,
    src_stride_layer,
    src_stride_block,
    dst_stride_layer,
    dst_stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Grid ``(pairs, layers, chunks)``: copy one chunk of one block of one layer.

    A block's ``block_size * KVH * D`` elements are contiguous, so each
    program moves a flat ``CHUNK`` of them.
    """
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    src_block = tl.load(src_blocks + pair)
    dst_block = tl.load(dst_blocks + pair)
    x = tl.load(src + layer * src_stride_layer + src_block * src_stride_block + offs, mask=mask)
    tl.store(dst + layer * dst_stride_layer + dst_block * dst_stride_block + offs, x, mask=mask)


def _blocks_are_contiguous(cache: torch.Tensor) -> bool:
    inner = cache.shape[2:]
    expected = [math.prod(inner[i + 1 :]) for i in range(len(inner))]
    return list(cache.stride()[2:]) == expected


def _copy_blocks_torch(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor
) -> None:
    """Copy through torch: works across devices (swap in and out of host memory).

    Swap-in from a pinned host pool gathers into a pinned staging buffer so
    the upload is asynchronous on the current stream (the caching host
    allocator keeps the buffer alive until the copy ends). Swap-out stays
    synchronous: the host-side scatter has to wait for the data anyway, and
    a non-blocking download into pageable memory would race with it.
    """
    src_idx = src_blocks.to(src_cache.device, torch.long)
    dst_idx = dst_blocks.to(dst_cache.device, torch.long)
    if src_cache.device.type == "cpu" and dst_cache.device.type != "cpu" and src_cache.is_pinned():
        staged_shape = (src_cache.shape[0], src_idx.numel(), *src_cache.shape[2:])
        staged = torch.empty(staged_shape, dtype=src_cache.dtype, pin_memory=True)
        torch.index_select(src_cache, 1, src_idx, out=staged)
        gathered = staged.to(dst_cache.device, non_blocking=True)
    else:
        gathered = src_cache.index_select(1, src_idx).to(dst_cache.device)
    dst_cache.index_copy_(1, dst_idx, gathered)


def copy_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor
) -> None:
    """Copy whole blocks between pools laid out ``[layers, num_blocks, ...]``.

    Same-device copies use one Triton launch for all layers and blocks; as all
    programs run concurrently, a block must not be both a source and a
    destination in one call (true for copy-on-write and swap, where
    destinations are freshly allocated). Cross-device copies go through torch.
    Both pools must share dtype and block shape (as ``index_copy_`` demands).
    """
    if src_cache.dtype != dst_cache.dtype or src_cache.shape[2:] != dst_cache.shape[2:]:
        src, dst = (f"{c.dtype} {tuple(c.shape)}" for c in (src_cache, dst_cache))
        raise ValueError(f"pools must share dtype and block shape: {src} vs {dst}")
    if src_blocks.numel() == 0:
        return
    same_device = src_cache.device == dst_cache.device
    triton_device = src_cache.device.type == "cuda" or _INTERPRETING
    contiguous = _blocks_are_contiguous(src_cache) and _blocks_are_contiguous(dst_cache)
    if not (same_device and triton_device and contiguous):
        _copy_blocks_torch(src_cache, dst_cache, src_blocks, dst_blocks)
        return
    block_numel = math.prod(src_cache.shape[2:])
    chunk = min(4096, _pow2(block_numel))
    src_idx = src_blocks.to(src_cache.device, torch.int64)
    dst_idx = dst_blocks.to(dst_cache.device, torch.int64)
    grid = (src_idx.numel(), src_cache.shape[0], triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        src_cache, dst_cache, src_idx, dst_idx,
        src_cache.stride(0), src_cache.stride(1), dst_cache.stride(0), dst_cache.stride(1),
        BLOCK_NUMEL=block_numel, CHUNK=chunk,
    )  # fmt: skip
