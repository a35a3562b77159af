"""Triton paged attention (interpreted on CPU) against the torch reference.

Cases are picked, not crossed: together they cover block sizes 8/16/32,
query-heads-per-KV-head 1/3/4, head dims 64/128, fp32/fp16/bf16 caches,
contexts ending on, just before and just after a block boundary, decode-only,
prefill-only and mixed batches, several query tiles per sequence and both
attention paths. Tolerances: ``kernel_cases.TOLERANCES``.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import assert_close_to_reference, paged_batch, reference_output

from paged_kernels import triton_ops

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

# (seq_lens, q_lens, block_size, heads, kv_heads, head_dim, dtype)
UNIFIED_CASES = {
    "decode-bs8-gqa1-d64-f32": ([8, 7, 9, 24], [1, 1, 1, 1], 8, 2, 2, 64, f32),
    "decode-bs16-gqa3-d128-f16": ([16, 15, 17], [1, 1, 1], 16, 3, 1, 128, f16),
    "decode-bs32-gqa4-d64-bf16": ([32, 31, 33], [1, 1, 1], 32, 8, 2, 64, bf16),
    "prefill-bs8-gqa4-d128-f32": ([23, 40], [23, 15], 8, 4, 1, 128, f32),
    "prefill-bs16-gqa1-d64-bf16": ([33, 47], [33, 20], 16, 1, 1, 64, bf16),
    "prefill-bs32-gqa3-d64-f16": ([31, 65], [31, 2], 32, 6, 2, 64, f16),
    "mixed-bs32-gqa3-d64-f32": ([64, 31, 96, 1], [1, 31, 30, 1], 32, 3, 1, 64, f32),
    "mixed-bs16-gqa4-d128-f16": ([47, 17, 49], [1, 17, 20], 16, 4, 1, 128, f16),
    "mixed-bs8-gqa1-d64-bf16": ([15, 9, 8, 16], [1, 9, 1, 7], 8, 2, 2, 64, bf16),
}


@pytest.mark.parametrize("case", UNIFIED_CASES.values(), ids=UNIFIED_CASES.keys())
def test_unified_attention_matches_reference(case):
    seq_lens, q_lens, block_size, heads, kv_heads, head_dim, dtype = case
    batch = paged_batch(
        seq_lens, q_lens, block_size=block_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype
    )
    out = triton_ops.unified_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    assert_close_to_reference(out, batch)


@pytest.mark.parametrize(("block_m", "tile_n"), [(16, 16), (32, 64)])
def test_unified_attention_small_query_tiles(block_m, tile_n):
    """Prefill chunks spanning several query tiles (and the binary search over
    tiles of many sequences), with key tiles smaller and larger than a block."""
    batch = paged_batch([19, 40, 1, 24, 33], [19, 17, 1, 9, 1], block_size=16, heads=4, kv_heads=1, head_dim=64, seed=3)
    out = triton_ops.unified_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, block_m=block_m, tile_n=tile_n
    )
    assert_close_to_reference(out, batch)


# (seq_lens, block_size, heads, kv_heads, head_dim, dtype, num_splits)
SPLIT_CASES = {
    "bs8-gqa1-d64-f32-3splits": ([8, 23, 25, 40], 8, 1, 1, 64, f32, 3),
    "bs16-gqa3-d128-f16-2splits": ([16, 47, 49], 16, 3, 1, 128, f16, 2),
    "bs32-gqa4-d64-bf16-4splits": ([63, 64, 65, 5], 32, 8, 2, 64, bf16, 4),
    "bs16-gqa4-d64-f32-mostly-empty-splits": ([3, 17], 16, 4, 1, 64, f32, 16),
}


@pytest.mark.parametrize("case", SPLIT_CASES.values(), ids=SPLIT_CASES.keys())
def test_split_kv_attention_matches_reference(case):
    seq_lens, block_size, heads, kv_heads, head_dim, dtype, num_splits = case
    batch = paged_batch(
        seq_lens,
        [1] * len(seq_lens),
        block_size=block_size,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=7,
    )
    out = triton_ops.split_kv_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, num_splits
    )
    assert_close_to_reference(out, batch)


def test_split_kv_attention_rejects_prefill():
    batch = paged_batch([9, 4], [3, 1], block_size=8, heads=2, kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="one query token per sequence"):
        triton_ops.split_kv_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale, 2)


def test_num_kv_splits_rule():
    decode_long = paged_batch([1100, 20], [1, 1], block_size=32, heads=2, kv_heads=1, head_dim=64).meta
    decode_short = paged_batch([300, 20], [1, 1], block_size=32, heads=2, kv_heads=1, head_dim=64).meta
    mixed_long = paged_batch([1100, 20], [1, 5], block_size=32, heads=2, kv_heads=1, head_dim=64).meta
    cpu = torch.device("cpu")
    splits = triton_ops.num_kv_splits(2, decode_long, 1, cpu)
    assert 1 < splits <= triton_ops.MAX_KV_SPLITS
    assert splits <= 1120 // triton_ops.SPLIT_KV_MIN_KEYS_PER_SPLIT
    assert triton_ops.num_kv_splits(2, decode_short, 1, cpu) == 1
    assert triton_ops.num_kv_splits(6, mixed_long, 1, cpu) == 1


@pytest.mark.parametrize("force_split", [True, False], ids=["split-kv", "unified"])
def test_paged_attention_dispatch(monkeypatch, force_split):
    """The public entry point picks the path by the rule and is exact either way."""
    if force_split:
        monkeypatch.setattr(triton_ops, "SPLIT_KV_MIN_CONTEXT", 16)
        monkeypatch.setattr(triton_ops, "SPLIT_KV_MIN_KEYS_PER_SPLIT", 16)
    else:
        monkeypatch.setattr(triton_ops, "SPLIT_KV_MIN_CONTEXT", 1 << 30)
    calls = []
    split_kv = triton_ops.split_kv_attention

    def spy(*args, **kwargs):
        calls.append(args[-1])
        return split_kv(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "split_kv_attention", spy)
    batch = paged_batch([40, 17, 33], [1, 1, 1], block_size=16, heads=4, kv_heads=2, head_dim=64, dtype=f16)
    out = triton_ops.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    assert_close_to_reference(out, batch)
    assert (len(calls) == 1 and calls[0] > 1) if force_split else not calls


def test_backend_uses_triton_ops():
    from paged_kernels import get_backend

    backend = get_backend("triton", torch.device("cpu"))
    batch = paged_batch([12, 5], [4, 1], block_size=8, heads=3, kv_heads=1, head_dim=64)
    out = backend.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    torch.testing.assert_close(out, reference_output(batch), atol=1e-5, rtol=1e-5)


@st.composite
def _random_batches(draw):
    num_seqs = draw(st.integers(1, 4))
    decode_only = draw(st.booleans())
    q_lens = [1 if decode_only else draw(st.sampled_from([1, draw(st.integers(2, 20))])) for _ in range(num_seqs)]
    seq_lens = [q + draw(st.integers(0, 40)) for q in q_lens]
    kv_heads = draw(st.integers(1, 2))
    return dict(
        seq_lens=seq_lens,
        q_lens=q_lens,
        block_size=draw(st.sampled_from([8, 16, 32])),
        heads=kv_heads * draw(st.sampled_from([1, 3, 4])),
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([64, 128])),
        dtype=draw(st.sampled_from([f32, f16, bf16])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(params=_random_batches(), num_splits=st.integers(1, 5))
def test_random_batches_match_reference(params, num_splits):
    """Seeded sweep over shapes the hand-picked cases do not combine."""
    batch = paged_batch(**params)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, batch.scale)
    assert_close_to_reference(triton_ops.unified_attention(*args), batch)
    if max(params["q_lens"]) == 1:
        assert_close_to_reference(triton_ops.split_kv_attention(*args, num_splits), batch)
