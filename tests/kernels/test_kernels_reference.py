"""The torch reference against plain causal attention over contiguous K/V."""

import pytest
import torch
import torch.nn.functional as F

from paged_kernels import reference


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one whole sequence: ``q [L, H, D]``, ``k/v [L, KVH, D]``."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    ("seq_lens", "q_lens", "block_size", "heads", "kv_heads"),
    [
        ([7, 16, 17], [1, 1, 1], 8, 4, 4),  # decode only
        ([9, 24], [9, 24], 8, 6, 2),  # whole prompts
        ([40], [15], 16, 4, 1),  # prefill chunk on 25 cached tokens
        ([33, 5, 64, 20], [1, 5, 31, 1], 16, 3, 1),  # mixed, chunk on cached context
        ([300, 3, 40, 41, 100, 9, 250], [1] * 7, 16, 6, 2),  # long-tailed decodes: several length buckets
        ([300, 20, 18, 150, 7], [40, 20, 18, 1, 7], 16, 4, 2),  # prefill chunks in two length buckets, a decode
    ],
)
def test_reference_matches_sdpa_causal(seq_lens, q_lens, block_size, heads, kv_heads):
    gen = torch.Generator().manual_seed(1)
    dim, scale = 16, 0.3
    # Whole sequences, written through the reference reshape_and_cache into a
    # pool with blocks in scrambled order.
    keys = [torch.randn(n, kv_heads, dim, generator=gen) for n in seq_lens]
    values = [torch.randn(n, kv_heads, dim, generator=gen) for n in seq_lens]
    queries = [torch.randn(n, heads, dim, generator=gen) for n in seq_lens]
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    block_tables = torch.randperm(num_blocks, generator=gen).view(len(seq_lens), max_blocks).to(torch.int32)
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    whole = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = reference.slot_mapping_for(block_tables, whole, seq_lens_t, block_size)
    reference.reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, slots)

    # This step's new tokens are the last q_len positions of each sequence.
    query = torch.cat([q[n - m :] for q, n, m in zip(queries, seq_lens, q_lens)])
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = reference.make_metadata(block_tables, query_start_loc, seq_lens_t, block_size)
    out = reference.paged_attention(query, key_cache, value_cache, meta, scale)

    expected = torch.cat(
        [_sdpa_causal(q, k, v, scale)[n - m :] for q, k, v, n, m in zip(queries, keys, values, seq_lens, q_lens)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_slot_mapping_points_at_last_positions():
    block_tables = torch.tensor([[5, 2], [0, 7]], dtype=torch.int32)
    meta = reference.make_metadata(
        block_tables, torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([5, 8], dtype=torch.int32), 4
    )
    # seq 0: position 4 -> block 2 offset 0; seq 1: positions 5..7 -> block 7.
    assert meta.slot_mapping.tolist() == [8, 29, 30, 31]


def test_decodes_are_padded_within_a_length_bucket_only():
    """A long tail does not pad every decode to the longest context: each group pads to under
    twice the block count of its shortest sequence."""
    seq_lens = [1000, 250, 240, 230, 17, 16]
    block_tables = torch.arange(len(seq_lens) * 63, dtype=torch.int32).view(len(seq_lens), 63)
    meta = reference.make_metadata(
        block_tables, torch.arange(len(seq_lens) + 1, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), 16
    )
    groups = reference._groups(meta)
    gathered = sum(len(g.blocks) for g in groups)
    assert len(groups) == 4 and gathered == 63 + 3 * 16 + 2 + 1  # not 6 x 63


def test_prefill_chunks_are_padded_within_a_length_bucket_only():
    """A chunk of a long prompt does not pad short whole prompts to its context (nor its query rows)."""
    seq_lens, q_lens = [1000, 20, 18], [64, 20, 18]
    block_tables = torch.arange(len(seq_lens) * 63, dtype=torch.int32).view(len(seq_lens), 63)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = reference.make_metadata(block_tables, starts, torch.tensor(seq_lens, dtype=torch.int32), 16)
    groups = reference._groups(meta)
    assert sorted(g.token_index.shape for g in groups) == [(1, 64), (2, 20)]
    assert sum(len(g.blocks) for g in groups) == 63 + 2 * 2  # not 3 x 63
