"""The torch reference and the CPU backend's compiled kernel (``cpu_attention.py``) against plain causal attention
over contiguous K/V; the kernel's result for a token whatever its row's chunking, batch and threads."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paged_kernels import cpu_attention, cpu_build, get_backend, reference


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> cpu_attention.Kernel:
    return cpu_attention.build(tmp_path_factory.mktemp("kernels"))


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
        ([90, 41, 200, 64], [6, 1, 3, 17], 16, 6, 2),  # decodes with drafts, a longer chunk
        ([5, 70], [5, 70], 4, 8, 8),  # blocks smaller than the kernel's 16-position key tile, no GQA
    ],
)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_reference_matches_sdpa_causal(seq_lens, q_lens, block_size, heads, kv_heads, backend, request):
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
    attention = (
        reference.paged_attention if backend == "torch" else cpu_attention.attention(request.getfixturevalue("kernel"))
    )
    out = attention(query, key_cache, value_cache, meta, scale)

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


def test_the_cpu_backend_builds_its_kernel_once_per_cpu_and_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cpu`` compiles the kernel into the cache directory and loads it from there next time; a CPU with
    other features (``-march=native``) gets a build of its own; ``auto`` on CPU is this backend."""
    assert get_backend("torch", torch.device("cpu"), tmp_path).name == "torch"
    assert not (tmp_path / "kernels").exists()
    assert get_backend("auto", torch.device("cpu"), tmp_path).name == "cpu"
    built = sorted((tmp_path / "kernels").iterdir())
    assert [p.name for p in built] == [cpu_attention.library_path(tmp_path).name]
    mtime = built[0].stat().st_mtime_ns
    assert get_backend("cpu", torch.device("cpu"), tmp_path).name == "cpu"
    assert built[0].stat().st_mtime_ns == mtime, "loaded, not rebuilt"
    monkeypatch.setattr(cpu_attention, "_cpu_signature", lambda: b"flags : sse2")
    assert cpu_attention.library_path(tmp_path) != built[0]


def test_without_a_compiler_the_cpu_backend_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Isolates the build's failure: no g++ on PATH (``shutil.which`` patched), an empty cache directory. Asked for
    by name, the backend raises the reason; ``auto`` keeps the torch reference."""
    monkeypatch.setattr(cpu_build.shutil, "which", lambda _: None)
    with pytest.raises(cpu_build.KernelUnavailable, match="no C\\+\\+ compiler"):
        get_backend("cpu", torch.device("cpu"), tmp_path)
    assert get_backend("auto", torch.device("cpu"), tmp_path).name == "torch"


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_the_kernel_on_any_number_of_threads(kernel: cpu_attention.Kernel, threads: int) -> None:
    """Two rows (a decode, and 5 new tokens: a decode with 4 drafts), then one, on 1, 2 and 4 threads: the output is
    the reference's, and the same bits on any number of threads."""
    gen = torch.Generator().manual_seed(3)
    block_size, heads, kv_heads, dim = 16, 6, 3, 32
    lens = torch.tensor([70, 33], dtype=torch.int32)
    tables = torch.randperm(12, generator=gen)[:10].view(2, 5).to(torch.int32)
    key_cache = torch.randn(12, block_size, kv_heads, dim, generator=gen)
    value_cache = torch.randn(12, block_size, kv_heads, dim, generator=gen)
    query = torch.randn(6, heads, dim, generator=gen)
    for rows, starts in ((2, [0, 1, 6]), (1, [0, 5])):
        loc = torch.tensor(starts, dtype=torch.int32)
        meta = reference.make_metadata(tables[:rows], loc, lens[:rows], block_size)
        q = query[: starts[-1]]
        expected = reference.paged_attention(q, key_cache, value_cache, meta, 0.2)
        out, one = torch.empty_like(expected), torch.empty_like(expected)
        kernel(q.contiguous(), key_cache, value_cache, meta, 0.2, out, threads)
        kernel(q.contiguous(), key_cache, value_cache, meta, 0.2, one, 1)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(out, one)


@pytest.mark.parametrize("chunk", [1, 3, 16, 37, 90])
def test_a_tokens_attention_does_not_depend_on_its_chunking_or_batch(kernel: cpu_attention.Kernel, chunk: int) -> None:
    """A 90-token sequence attended in one chunk, then in chunks of ``chunk`` (1: decode by decode), each chunk in a
    batch with other rows of other lengths: every token's output is the same bits. This is what lets a seeded request
    sample the same after a prefix-cache hit or a preemption's recompute (``tests/test_sampling.py``)."""
    gen = torch.Generator().manual_seed(5)
    block_size, heads, kv_heads, dim, n = 16, 9, 3, 64, 90
    key_cache = torch.randn(40, block_size, kv_heads, dim, generator=gen)
    value_cache = torch.randn(40, block_size, kv_heads, dim, generator=gen)
    tables = torch.randperm(40, generator=gen).view(5, 8).to(torch.int32)
    query = torch.randn(n, heads, dim, generator=gen)

    def attend(rows: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
        """rows: (table row, context length, new tokens' queries)."""
        loc = torch.tensor([0, *torch.tensor([len(q) for _, _, q in rows]).cumsum(0).tolist()], dtype=torch.int32)
        meta = reference.make_metadata(
            tables[[r for r, _, _ in rows]], loc, torch.tensor([c for _, c, _ in rows], dtype=torch.int32), block_size
        )
        q = torch.cat([q for _, _, q in rows])
        out = torch.empty_like(q)
        kernel(q, key_cache, value_cache, meta, 0.125, out)
        return out[: len(rows[0][2])]

    whole = attend([(0, n, query)])
    other = torch.randn(40, heads, dim, generator=gen)
    pieces = [
        attend([(0, min(n, s + chunk), query[s : s + chunk]), (1, 100, other[:1]), (2, 60, other[: 1 + s % 20])])
        for s in range(0, n, chunk)
    ]
    assert torch.equal(torch.cat(pieces), whole)


def test_where_a_rows_blocks_lie_changes_no_bit(kernel: cpu_attention.Kernel) -> None:
    """Decodes, a decode with drafts and a 40-token chunk (two rows sharing their first two blocks, as a prefix-cache
    hit does), then the same with every block moved elsewhere in the pool: the same bits, on 1 and 2 threads. Short
    rows are read block by block in the pool's order (``sweep``); a token's sums follow its table, not the pool."""
    gen = torch.Generator().manual_seed(7)
    block_size, heads, kv_heads, dim, blocks = 16, 9, 3, 64, 48
    key_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    value_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    tables = torch.randperm(blocks, generator=gen)[:40].view(4, 10).to(torch.int32)
    tables[1, :2] = tables[0, :2]  # a shared prefix
    lens = torch.tensor([150, 37, 96, 160], dtype=torch.int32)
    loc = torch.tensor([0, 1, 6, 7, 47], dtype=torch.int32)  # a decode, 5 drafts, a decode, a chunk of 40
    query = torch.randn(47, heads, dim, generator=gen)
    meta = reference.make_metadata(tables, loc, lens, block_size)
    want = torch.empty_like(query)
    kernel(query, key_cache, value_cache, meta, 0.125, want)
    torch.testing.assert_close(want, reference.paged_attention(query, key_cache, value_cache, meta, 0.125))
    moved = torch.randperm(blocks, generator=gen)  # block b now lies at moved[b]
    k2, v2 = torch.empty_like(key_cache), torch.empty_like(value_cache)
    k2[moved], v2[moved] = key_cache, value_cache
    meta2 = reference.make_metadata(moved[tables.long()].to(torch.int32), loc, lens, block_size)
    for threads in (1, 2):
        got = torch.empty_like(query)
        kernel(query, k2, v2, meta2, 0.125, got, threads)
        assert torch.equal(got, want), f"{threads} threads"


def test_rope_and_cache_in_c_gives_the_reference_bits(tmp_path: Path) -> None:
    """The cpu backend's ``rope_and_cache`` (one C call) against the reference's (torch ops): the rotated q and every
    cache slot written are the same bits; a slot of -1 is skipped; strided rows (q/k/v as column slices of one
    product, as a fused GEMM leaves them) too."""
    gen = torch.Generator().manual_seed(9)
    t, h, kvh, d, bs = 7, 6, 2, 32, 4
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen) * 3
    q, k, v = (x.view(t, -1, d) for x in qkv.split([h * d, kvh * d, kvh * d], dim=-1))
    cos, sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    slots = torch.tensor([5, 0, -1, 9, 13, 2, 11])
    c_backend = get_backend("cpu", torch.device("cpu"), tmp_path)
    t_backend = get_backend("torch", torch.device("cpu"), tmp_path)
    caches = [(torch.zeros(4, bs, kvh, d), torch.zeros(4, bs, kvh, d)) for _ in range(2)]
    q_c = c_backend.rope_and_cache(q.clone(), k, v, cos, sin, *caches[0], slots)
    q_t = t_backend.rope_and_cache(q.clone(), k, v, cos[:, None], sin[:, None], *caches[1], slots)
    assert torch.equal(q_c, q_t)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert int((caches[0][0].view(-1, kvh, d).abs().sum((1, 2)) > 0).sum()) == 6, "six slots written, -1 skipped"
