"""Torch reference implementations of the paged-KV operations.

They define the semantics the Triton kernels must reproduce, and they are what
the executor runs on CPU. Shapes (one layer of the pool):

- ``query``: ``[T, H, D]``, the packed new tokens of every sequence in the step.
- ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, KVH, D]``.
- ``meta.block_tables``: ``[S, max_blocks]`` int32, physical block per logical block.
- ``meta.query_start_loc``: ``[S + 1]`` int32, offsets of each sequence's tokens in ``query``.
- ``meta.seq_lens``: ``[S]`` int32, context length after this step (cached + new).

A sequence's new tokens are the last ``q_len`` positions of its context, so
context already in the cache is ``seq_len - q_len`` (a prefill chunk or a
decode token on top of earlier context).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class _Group:
    """Sequences padded together: decodes (q_len 1) or prefill chunks."""

    token_index: torch.Tensor  # [S_g, Q_g] index into the packed tokens
    token_valid: torch.Tensor  # [S_g, Q_g] bool
    blocks: torch.Tensor  # [S_g * B_g] physical blocks covering each sequence's context, flattened
    mask: torch.Tensor  # [S_g, 1, Q_g, B_g * block_size] bool, True where attention is allowed


@dataclass(slots=True)
class PagedMetadata:
    """Per-step attention inputs, shared by every layer of the forward pass.

    The torch path derives its gather indices and masks once per step (not once
    per layer) and caches them in ``groups``.
    """

    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64 flat slot of each new token
    groups: list[_Group] | None = field(default=None)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def slot_mapping_for(
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat cache slot (``block * block_size + offset``) of every packed token."""
    dev = block_tables.device
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens), device=dev), q_lens)
    first_pos = (seq_lens.long() - q_lens)[seq_of_token]
    offset_in_seq = torch.arange(int(q_lens.sum()), device=dev) - query_start_loc[:-1].long()[seq_of_token]
    pos = first_pos + offset_in_seq
    blocks = block_tables.long()[seq_of_token, pos // block_size]
    return blocks * block_size + pos % block_size


def make_metadata(
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> PagedMetadata:
    return PagedMetadata(
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_size=block_size,
        slot_mapping=slot_mapping_for(block_tables, query_start_loc, seq_lens, block_size),
    )


def _build_group(meta: PagedMetadata, seqs: torch.Tensor) -> _Group:
    starts = meta.query_start_loc[:-1].long()[seqs]
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()[seqs]
    ctx = meta.seq_lens.long()[seqs]
    q_max, l_max = int(q_lens.max()), int(ctx.max())
    dev = meta.block_tables.device
    qi = torch.arange(q_max, device=dev)
    token_valid = qi[None, :] < q_lens[:, None]
    token_index = torch.where(token_valid, starts[:, None] + qi[None, :], 0)
    # Gather whole blocks (contiguous 16-token rows are far cheaper than per-slot
    # indexing); positions past a sequence's context are masked out.
    num_blocks = -(-l_max // meta.block_size)
    blocks = meta.block_tables.long()[seqs][:, :num_blocks].reshape(-1)
    pos = torch.arange(num_blocks * meta.block_size, device=dev)
    # Query i of a sequence sits at position ctx - q_len + i and sees keys up to it.
    q_pos = (ctx - q_lens)[:, None] + qi[None, :]
    mask = pos[None, None, :] <= q_pos[:, :, None]
    # Padded query rows would see nothing (NaN in softmax): let them see key 0.
    mask = mask | (~token_valid[:, :, None] & (pos == 0)[None, None, :])
    return _Group(token_index, token_valid, blocks, mask[:, None])


def _bucketed(meta: PagedMetadata, seqs: torch.Tensor) -> list[_Group]:
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1])[seqs]
    num_blocks = (meta.seq_lens.long()[seqs] + meta.block_size - 1) // meta.block_size
    level = torch.ceil(torch.log2(num_blocks.clamp(min=1).double())).long()
    bucket = torch.where(q_lens == 1, level, level + 64)  # 64 levels cover any context
    return [_build_group(meta, seqs[bucket == b]) for b in torch.unique(bucket).tolist()]


def _groups(meta: PagedMetadata) -> list[_Group]:
    """Decodes, then prefill chunks, each bucketed by context length (the power of two at or above
    their block count).

    A group gathers every sequence's KV padded to its longest context, once per layer: with one
    decode group, a long-tailed batch (one 1,000-token context among a dozen of ~250) gathered and
    attended over ~3x the tokens it holds, which made the step's time grow with the longest
    sequence rather than with the tokens. Within a bucket the context's padding is under 2x.
    Prefill chunks apart from decodes: their query rows pad to the longest chunk of the group."""
    if meta.groups is None:
        meta.groups = _bucketed(meta, torch.arange(meta.num_seqs, device=meta.block_tables.device))
    return meta.groups


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedMetadata, float], torch.Tensor]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V ``[T, KVH, D]`` into the cache slots; slots < 0 are skipped."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    kvh, d = key_cache.shape[-2:]
    key_cache.view(-1, kvh, d).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, kvh, d).index_copy_(0, slots, value.to(value_cache.dtype))


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [T, heads, D]``, ``cos``/``sin_signed`` ``[T, 1, D]``.

    ``rotate_half(x)`` is ``cat(-x2, x1)``; ``roll(x, D/2)`` is ``cat(x2, x1)``, and ``-a * b == a * -b`` exactly,
    so with ``sin_signed = cat(-sin1, sin2)`` every element is the same product and sum as transformers'.
    """
    return (x * cos).add_(torch.roll(x, x.shape[-1] // 2, -1).mul_(sin_signed))


RopeAndCacheFn = Callable[..., torch.Tensor]


def rope_then(write: Callable[..., None]) -> RopeAndCacheFn:
    """A backend's ``rope_and_cache(q, k, v, cos, sin_signed, key_cache, value_cache, slot_mapping) -> q``: q and k
    rotated (``rope``; ``cos``/``sin_signed`` hold ``[T, D]`` elements), then k and v written into their slots by
    ``write`` (a backend's ``reshape_and_cache``)."""

    def rope_and_cache(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        cos, sin_signed = cos.view(q.shape[0], 1, -1), sin_signed.view(q.shape[0], 1, -1)
        write(rope(k, cos, sin_signed), v.contiguous(), key_cache, value_cache, slot_mapping)
        return rope(q, cos, sin_signed)

    return rope_and_cache


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    Vectorised across sequences: decode tokens (by context-length bucket) and
    prefill chunks form padded groups, each one batched
    ``scaled_dot_product_attention`` call (``_groups``).
    """
    heads, dim = query.shape[1:]
    kvh = key_cache.shape[-2]
    out = torch.empty_like(query)
    for g in _groups(meta):
        s_g, q_g = g.token_index.shape
        q = query.index_select(0, g.token_index.reshape(-1)).view(s_g, q_g, heads, dim).transpose(1, 2)
        k = key_cache.index_select(0, g.blocks).view(s_g, -1, kvh, dim).transpose(1, 2).to(query.dtype)
        v = value_cache.index_select(0, g.blocks).view(s_g, -1, kvh, dim).transpose(1, 2).to(query.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=g.mask, scale=scale, enable_gqa=heads != kvh
        )
        o = o.transpose(1, 2)  # [S, Q, H, D]
        if q_g == 1:
            out.index_copy_(0, g.token_index.reshape(-1), o.reshape(s_g, heads, dim))
        else:
            out[g.token_index[g.token_valid]] = o[g.token_valid]
    return out


def copy_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor
) -> None:
    """Copy whole blocks between pools laid out ``[layers, num_blocks, ...]``.

    Source and destination may be the same pool (copy-on-write,
    defragmentation) or live on different devices (swap to or from host memory).
    """
    src_idx = src_blocks.long().to(src_cache.device)
    dst_idx = dst_blocks.long().to(dst_cache.device)
    dst_cache.index_copy_(1, dst_idx, src_cache.index_select(1, src_idx).to(dst_cache.device))
