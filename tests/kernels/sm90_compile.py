"""Compile the Triton kernels for sm_90 (H100/H200) without a GPU.

Run as a script in a process *without* ``TRITON_INTERPRET`` (the test suite's
own process interprets). Triton lowers to PTX and its bundled ``ptxas``
assembles a cubin, so GPU-only constraints (dot shapes, early returns,
loops, layouts) are checked here. The signature mimics what the JIT derives
at launch: unit last-dim strides are constants, pointers and other strides
16-divisible. Prints one JSON object: kernel config -> cuobjdump resource line.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from paged_kernels import triton_ops as ops

BF16 = {"dtype": "bf16", "DOT_DTYPE": tl.bfloat16, "DOT_PRECISION": "tf32"}
ATTN_PTRS = ("out", "query", "key_cache", "value_cache")
INDEX_PTRS = {"block_tables": "*i32", "query_start_loc": "*i32", "seq_lens": "*i32"}
PARTIALS = {"part_acc": "*fp32", "part_max": "*fp32", "part_sum": "*fp32"}


def resource_usage(kernel, pointers: dict[str, str], constexprs: dict) -> str:
    params = list(inspect.signature(kernel.fn).parameters)
    constexprs = constexprs | {p: 1 for p in params if p.startswith("stride_") and p.endswith("d")}
    signature = {}
    for p in params:
        if p in constexprs:
            signature[p] = "constexpr"
        elif p in pointers:
            signature[p] = pointers[p]
        else:
            signature[p] = "fp32" if p == "qk_scale" else "i32"
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, p in enumerate(params)
        if p in pointers or (p.startswith("stride_") and p not in constexprs)
    }
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    return usage.stdout.strip().splitlines()[-1].strip()


def main() -> None:
    attn = {p: "*bf16" for p in ATTN_PTRS} | INDEX_PTRS
    common = {"HEAD_DIM": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 16, "TILE_N": 32}
    dots = {k: v for k, v in BF16.items() if k != "dtype"}
    configs = {
        "unified decode bf16 (GQA 4)": (
            ops._unified_attention_kernel,
            attn,
            common | dots | {"QUERIES_PER_KV": 4, "QPK_PAD": 4, "BLOCK_M": 16, "BLOCK_Q": 4},
        ),
        "unified prefill bf16 (GQA 3)": (
            ops._unified_attention_kernel,
            attn,
            common | dots | {"QUERIES_PER_KV": 3, "QPK_PAD": 4, "BLOCK_M": 64, "BLOCK_Q": 16},
        ),
        "unified prefill fp32": (
            ops._unified_attention_kernel,
            {p: "*fp32" for p in ATTN_PTRS} | INDEX_PTRS,
            common
            | {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}
            | {"QUERIES_PER_KV": 1, "QPK_PAD": 1, "BLOCK_M": 32, "BLOCK_Q": 32},
        ),
        "split-kv bf16 (GQA 4)": (
            ops._split_kv_kernel,
            {p: "*bf16" for p in ATTN_PTRS[1:]} | INDEX_PTRS | PARTIALS,
            common | dots | {"NUM_HEADS": 32, "NUM_SPLITS": 4, "QUERIES_PER_KV": 4, "BLOCK_M": 16},
        ),
        "split-kv reduce": (
            ops._split_kv_reduce_kernel,
            {"out": "*bf16", "query_start_loc": "*i32"} | PARTIALS,
            {"NUM_HEADS": 32, "NUM_SPLITS": 5, "SPLITS_PAD": 8, "HEAD_DIM": 128, "HEAD_PAD": 128},
        ),
        "reshape_and_cache": (
            ops._reshape_and_cache_kernel,
            {p: "*bf16" for p in ("key", "value", "key_cache", "value_cache")} | {"slot_mapping": "*i64"},
            {"KV_HEADS": 3, "HEADS_PAD": 4, "HEAD_DIM": 64, "HEAD_PAD": 64, "BLOCK_SIZE": 16},
        ),
        "copy_blocks": (
            ops._copy_blocks_kernel,
            {"src": "*bf16", "dst": "*bf16", "src_blocks": "*i64", "dst_blocks": "*i64"},
            {"BLOCK_NUMEL": 16 * 8 * 128, "CHUNK": 4096},
        ),
    }
    json.dump({name: resource_usage(*config) for name, config in configs.items()}, sys.stdout)


if __name__ == "__main__":
    main()
