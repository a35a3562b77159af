"""Paged-attention kernel benchmark: memory bandwidth and time against SDPA.

``python -m benchmarks.kernels [--peak-gbps N] [--out results.json]``

For each batch (decode-only and mixed prefill/decode) it times the Triton
``paged_attention`` (and, for decode, both of its paths) and PyTorch
``scaled_dot_product_attention`` over the same K/V laid out contiguously
(decode: one padded batch; mixed: one call per group). Achieved bandwidth
counts the bytes a perfect kernel must move: every context token's K and V
once, plus Q and the output; block tables and partial results are left out.
Needs CUDA; elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

# Peak HBM bandwidth (GB/s) by substring of the CUDA device name, most
# specific first. Vendor datasheet figures.
PEAK_GBPS: list[tuple[str, float]] = [
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5 ("H100 80GB HBM3")
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Batch:
    name: str
    decode_seqs: int
    decode_ctx: int
    prefill_seqs: int = 0
    prefill_cached: int = 0  # context already in the cache under each chunk
    prefill_chunk: int = 0


BATCHES = [
    Batch("decode 64 x ctx 1024", 64, 1024),
    Batch("decode 64 x ctx 4096", 64, 4096),
    Batch("decode 8 x ctx 8192", 8, 8192),
    Batch("mixed: 4 chunks 512 on 1024 + 60 decodes ctx 2048", 60, 2048, 4, 1024, 512),
    Batch("mixed: 2 chunks 2048 on 0 + 126 decodes ctx 1024", 126, 1024, 2, 0, 2048),
]


@dataclass
class Row:
    batch: str
    path: str
    triton_us: float
    gbps: float
    peak_fraction: float | None
    sdpa_us: float
    time_ratio_vs_sdpa: float  # triton time / SDPA time: below 1 is faster
    max_abs_err: float


def peak_gbps_for(device_name: str) -> float | None:
    for key, gbps in PEAK_GBPS:
        if key in device_name:
            return gbps
    return None


def _build(batch: Batch, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: str):
    """Paged pool with scattered blocks, plus the same K/V per sequence contiguous.

    Returns the paged inputs, the SDPA groups ``(q, k, v)`` in packed token
    order (prefill chunks first) and the bytes a perfect kernel moves.
    SDPA's bottom-right causal mask does not take GQA in every backend, so
    the prefill group's K/V are expanded to all query heads; prefill is
    compute-bound, so that barely changes its time.
    """
    from paged_kernels.reference import PagedMetadata, slot_mapping_for

    gen = torch.Generator().manual_seed(0)
    q_lens = [batch.prefill_chunk] * batch.prefill_seqs + [1] * batch.decode_seqs
    prefill_len = batch.prefill_cached + batch.prefill_chunk
    seq_lens = [prefill_len] * batch.prefill_seqs + [batch.decode_ctx] * batch.decode_seqs
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = perm[start : start + n]
        start += n
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    slot_mapping = slot_mapping_for(block_tables, query_start_loc, seq_lens_t, block_size)
    meta = PagedMetadata(
        block_tables=block_tables.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_size=block_size,
        slot_mapping=slot_mapping.to(device),
    )
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, device=device, dtype=dtype)
    value_cache = torch.randn(shape, device=device, dtype=dtype)
    query = torch.randn(int(query_start_loc[-1]), heads, head_dim, device=device, dtype=dtype)

    def group(seqs: range, q_len: int, length: int, repeat: int) -> tuple[torch.Tensor, ...]:
        """SDPA inputs ``[len(seqs), heads, L, D]`` of sequences sharing lengths."""
        tokens = query[query_start_loc[seqs.start] : query_start_loc[seqs.stop]]
        q = tokens.view(len(seqs), q_len, heads, head_dim).transpose(1, 2).contiguous()
        pos = torch.arange(length)
        slots = block_tables[seqs.start : seqs.stop].long()[:, pos // block_size] * block_size + pos % block_size
        kv = [
            cache.view(-1, kv_heads, head_dim)[slots.to(device)].repeat_interleave(repeat, dim=2)
            for cache in (key_cache, value_cache)
        ]
        return q, *(x.transpose(1, 2).contiguous() for x in kv)

    groups = []
    if batch.prefill_seqs:
        prefill = range(batch.prefill_seqs)
        groups.append(group(prefill, batch.prefill_chunk, prefill_len, heads // kv_heads))
    groups.append(group(range(batch.prefill_seqs, len(seq_lens)), 1, batch.decode_ctx, 1))

    elem = key_cache.element_size()
    moved = (2 * sum(seq_lens) * kv_heads * head_dim + 2 * query.numel()) * elem
    return query, key_cache, value_cache, meta, groups, moved


def _sdpa(groups, scale: float) -> Callable[[], list[torch.Tensor]]:
    from torch.nn.attention.bias import causal_lower_right

    def run() -> list[torch.Tensor]:
        outs = []
        for q, k, v in groups:
            # Chunks see their cached context: causal aligned bottom-right.
            mask = causal_lower_right(q.shape[2], k.shape[2]) if q.shape[2] > 1 else None
            gqa = q.shape[1] != k.shape[1]
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa))
        return outs

    return run


def _measure(batch: Batch, args: argparse.Namespace, peak: float | None) -> list[Row]:
    """Time SDPA and every Triton path on one batch; check them against SDPA."""
    import triton.testing

    from paged_kernels import triton_ops

    scale = args.head_dim**-0.5
    query, key_cache, value_cache, meta, groups, moved = _build(
        batch, args.heads, args.kv_heads, args.head_dim, args.block_size, DTYPES[args.dtype], "cuda"
    )
    inputs = (query, key_cache, value_cache, meta, scale)
    sdpa = _sdpa(groups, scale)
    expected = torch.cat([o.transpose(1, 2).reshape(-1, args.heads, args.head_dim) for o in sdpa()])
    sdpa_ms = triton.testing.do_bench(sdpa, return_mode="median")

    splits = triton_ops.num_kv_splits(query.shape[0], meta, args.kv_heads, query.device)
    chosen = f"split-kv x{splits}" if splits > 1 else "unified"
    paths: dict[str, Callable[[], torch.Tensor]] = {f"auto ({chosen})": lambda: triton_ops.paged_attention(*inputs)}
    if not batch.prefill_seqs:
        paths["unified"] = lambda: triton_ops.unified_attention(*inputs)
        for n in sorted({max(splits, 2), 8}):
            paths[f"split-kv x{n}"] = lambda n=n: triton_ops.split_kv_attention(*inputs, n)

    rows = []
    for path, fn in paths.items():
        err = (fn().float() - expected.float()).abs().max().item()
        ms = triton.testing.do_bench(fn, return_mode="median")
        gbps = moved / (ms * 1e-3) / 1e9
        frac = gbps / peak if peak else None
        rows.append(Row(batch.name, path, ms * 1e3, gbps, frac, sdpa_ms * 1e3, ms / sdpa_ms, err))
    return rows


def _print_table(rows: list[Row]) -> None:
    print("| batch | path | Triton µs | GB/s | of peak | SDPA µs | Triton/SDPA time | max abs err |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        frac = f"{r.peak_fraction:.1%}" if r.peak_fraction is not None else "n/a"
        print(
            f"| {r.batch} | {r.path} | {r.triton_us:.1f} | {r.gbps:.0f} | {frac} | {r.sdpa_us:.1f} "
            f"| {r.time_ratio_vs_sdpa:.2f} | {r.max_abs_err:.2e} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-gbps", type=float, help="device peak memory bandwidth (default: by device name)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("CUDA is not available: the kernel benchmark needs a CUDA device; nothing measured.")
        return 0

    device_name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_gbps_for(device_name)
    rows = [row for batch in BATCHES for row in _measure(batch, args, peak)]
    print(
        f"\n{device_name}, {args.dtype}, H={args.heads} KVH={args.kv_heads} D={args.head_dim} "
        f"block {args.block_size}, peak {peak or 'unknown (pass --peak-gbps)'} GB/s\n"
    )
    _print_table(rows)
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        report = {"device": device_name, "peak_gbps": peak, "config": config, "rows": [asdict(r) for r in rows]}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
