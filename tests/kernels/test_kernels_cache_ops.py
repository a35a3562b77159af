"""Triton reshape_and_cache and copy_blocks against the torch reference.

Both only move data (plus a dtype cast), so results must be bit-identical.
"""

import pytest
import torch

from paged_kernels import reference, triton_ops


def _pools(gen, layers, num_blocks, block_size=8, kv_heads=2, dim=16, dtype=torch.float32):
    shape = (layers, num_blocks, block_size, kv_heads, dim)
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype", "block_size", "kv_heads", "dim"),
    [
        (torch.float32, torch.float32, 8, 3, 64),
        (torch.float32, torch.float16, 16, 1, 128),
        (torch.bfloat16, torch.bfloat16, 32, 2, 64),
        (torch.float32, torch.bfloat16, 8, 4, 64),
    ],
)
def test_reshape_and_cache_matches_reference(src_dtype, cache_dtype, block_size, kv_heads, dim):
    gen = torch.Generator().manual_seed(0)
    num_blocks, tokens = 6, 11
    # K and V as views into a fused projection output: strided, not contiguous.
    kv = torch.randn(tokens, 2 * kv_heads, dim, generator=gen).to(src_dtype)
    key, value = kv[:, :kv_heads], kv[:, kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5, 10]] = -1  # padding tokens
    cache_shape = (num_blocks, block_size, kv_heads, dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(cache_dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(cache_dtype)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    before_k = key_cache.clone()

    triton_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    reference.reshape_and_cache(key, value, want_k, want_v, slots)

    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)
    # The reference is not the only witness: real slots hold the token's K/V,
    # every other slot (padding tokens' included) kept its old contents.
    kept = slots >= 0
    flat_k, flat_before = key_cache.view(-1, kv_heads, dim), before_k.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[slots[kept]], key[kept].to(cache_dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.equal(flat_k[untouched], flat_before[untouched])


def test_reshape_and_cache_all_slots_skipped_leaves_cache_untouched():
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(3, 1, 16, generator=gen)
    key_cache = torch.randn(2, 8, 1, 16, generator=gen)
    value_cache = torch.randn(2, 8, 1, 16, generator=gen)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    triton_ops.reshape_and_cache(key, key, key_cache, value_cache, torch.full((3,), -1))
    assert torch.equal(key_cache, before_k)
    assert torch.equal(value_cache, before_v)


def test_copy_blocks_within_one_pool():
    gen = torch.Generator().manual_seed(2)
    pool = _pools(gen, layers=3, num_blocks=10, dtype=torch.float16)
    want = pool.clone()
    src, dst = torch.tensor([3, 0, 5, 9]), torch.tensor([7, 2, 6, 1])
    triton_ops.copy_blocks(pool, pool, src, dst)
    reference.copy_blocks(want, want, src, dst)
    assert torch.equal(pool, want)
    assert torch.equal(pool[:, 7], pool[:, 3])


@pytest.mark.parametrize("path", ["triton", "torch-fallback"])
def test_copy_blocks_between_pools(path):
    """Two CPU pools of different sizes: swap-out shape (the device side is a
    second tensor). The torch fallback is the cross-device path."""
    gen = torch.Generator().manual_seed(3)
    src_pool = _pools(gen, layers=2, num_blocks=9, block_size=16, kv_heads=1, dim=64)
    dst_pool = _pools(gen, layers=2, num_blocks=4, block_size=16, kv_heads=1, dim=64)
    want = dst_pool.clone()
    src, dst = torch.tensor([8, 1, 4], dtype=torch.int32), torch.tensor([0, 3, 2], dtype=torch.int32)
    copy = triton_ops.copy_blocks if path == "triton" else triton_ops._copy_blocks_torch
    copy(src_pool, dst_pool, src, dst)
    reference.copy_blocks(src_pool, want, src, dst)
    assert torch.equal(dst_pool, want)
    assert torch.equal(dst_pool[:, 0], src_pool[:, 8])
    assert torch.equal(dst_pool[:, 1], want[:, 1])


def test_copy_blocks_empty_is_a_no_op():
    gen = torch.Generator().manual_seed(4)
    pool = _pools(gen, layers=1, num_blocks=3)
    before = pool.clone()
    triton_ops.copy_blocks(pool, pool, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    assert torch.equal(pool, before)


def test_copy_blocks_rejects_mismatched_pools():
    gen = torch.Generator().manual_seed(5)
    src = _pools(gen, layers=1, num_blocks=3)
    dst = _pools(gen, layers=1, num_blocks=3, dtype=torch.float16)
    with pytest.raises(ValueError, match="share dtype"):
        triton_ops.copy_blocks(src, dst, torch.tensor([0]), torch.tensor([1]))
