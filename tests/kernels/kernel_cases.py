"""Builders for small paged batches shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_kernels import reference
from paged_kernels.reference import PagedMetadata

SPARE_BLOCKS = 5

# Per cache dtype: (atol, rtol) of kernel output against the fp32 reference
# over the same (already quantised) inputs. fp32 is limited by summation
# order only; 16-bit runs also round the output (and, on GPU, q and the
# softmax weights) to the cache dtype: fp16 has 11 mantissa bits, bf16 8.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor
    meta: PagedMetadata
    scale: float


def paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random batch whose blocks are scattered over the pool (a permutation).

    The pool has spare blocks; unused block-table entries point at them, so
    a kernel reading past a context picks up random data and fails the test.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(seq_lens)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    used = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(used) + SPARE_BLOCKS
    pool = torch.randperm(num_blocks, generator=gen)
    spare = pool[sum(used) :]
    block_tables = spare[torch.randint(SPARE_BLOCKS, (num_seqs, max_blocks), generator=gen)]
    for s, (n, start) in enumerate(zip(used, [0, *torch.tensor(used).cumsum(0).tolist()])):
        block_tables[s, :n] = pool[start : start + n]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = reference.make_metadata(
        block_tables.to(torch.int32), query_start_loc, torch.tensor(seq_lens, dtype=torch.int32), block_size
    )
    query = torch.randn(int(query_start_loc[-1]), heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(query, key_cache, value_cache, meta, head_dim**-0.5)


def reference_output(batch: PagedBatch) -> torch.Tensor:
    """The torch reference in fp32 over the batch's (possibly 16-bit) values."""
    return reference.paged_attention(
        batch.query.float(), batch.key_cache.float(), batch.value_cache.float(), batch.meta, batch.scale
    )


def assert_close_to_reference(out: torch.Tensor, batch: PagedBatch) -> None:
    assert out.shape == batch.query.shape
    assert out.dtype == batch.query.dtype
    atol, rtol = TOLERANCES[batch.key_cache.dtype]
    torch.testing.assert_close(out.float(), reference_output(batch), atol=atol, rtol=rtol)
