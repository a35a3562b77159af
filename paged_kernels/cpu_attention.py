"""Paged attention on CPU, compiled here: the ``cpu`` attention backend (``auto``'s choice on CPU).

The torch reference (``reference.py``) gathers every row's blocks into a padded tensor, once per layer, then runs
SDPA: each step reads its rows' KV three times and writes it once. ``cpu/attention.cpp`` reads K and V in place
through the block table, once (vLLM's CPU attention does the same), for every row of the step: decodes, decodes with
drafts to verify, prefill chunks of any length (rows of a few tokens read the step's blocks in the pool's order, not
row after row: the source's header says why). It is plain C with an ``extern "C"`` entry, compiled with the
system's ``g++`` at first use into the cache directory and called through ``ctypes`` (no torch headers: it builds in
about a second). ``-march=native``: the library's name carries a digest of the source, the flags and this CPU's model
and feature flags, so a cache shared between machines never runs code built for another CPU.

**A token's attention does not depend on its row** (the source's header says how): a prompt computed in one chunk
or, after a prefix-cache hit, as a tail, a decoded token or the same token recomputed inside a chunk after a
preemption, in a batch of one or of 32, on one thread or two, all give the same bits. So a seeded request samples
the same tokens with the same logprobs across those (``tests/test_sampling.py``), which the reference's SDPA does
not promise between a decode and a chunk. An earlier version took only rows of up to 16 new tokens and left longer
chunks to SDPA; a token's path then depended on its chunking, and a seeded request's logprobs moved in the 7th digit
after a preemption.

``build`` raises ``KernelUnavailable`` with the reason (no compiler, a failed build); ``auto`` then keeps the torch
reference, ``cpu`` asked for by name stops the executor.
"""

from __future__ import annotations

import ctypes
import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_kernels import reference
from paged_kernels.cpu_build import KernelUnavailable, compile_library
from paged_kernels.reference import PagedMetadata

# One library: the attention kernels, and the sampler's draw (``cpu_race.py``).
SOURCES = tuple(Path(__file__).with_name("cpu") / name for name in ("attention.cpp", "race.cpp"))
# -ffp-contract=off: a multiply-add is fused only where the source says fmaf, so a loop's vectorised body and its scalar
# tail compute the same bits; -fno-trapping-math lets the exp loop vectorise (its clamp may be computed
# unconditionally); no reassociation (no -ffast-math), so the results are what the source says.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
_P, _I = ctypes.c_void_p, ctypes.c_int64
ONE_THREAD_TOKENS = 1  # a step of one row of this many tokens (a decode) runs on one thread (``Kernel.__call__``)


def _cpu_signature() -> bytes:
    """What ``-march=native`` compiles for: the CPU's model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep).encode()


def library_path(cache_dir: Path) -> Path:
    sources = b"".join(src.read_bytes() for src in SOURCES)
    digest = hashlib.sha256(sources + " ".join(FLAGS).encode() + _cpu_signature()).hexdigest()[:16]
    return cache_dir / "kernels" / f"paged_attention-{digest}.so"


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


@dataclass(frozen=True, slots=True)
class Kernel:
    """``cpu/attention.cpp``'s entry, loaded."""

    fn: ctypes._CFuncPtr  # type: ignore[name-defined]

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: PagedMetadata,
        scale: float,
        out: torch.Tensor,
        threads: int | None = None,
    ) -> None:
        """``query``/``out`` ``[T, H, D]`` (every row's new tokens, row after row), caches
        ``[num_blocks, BS, KVH, D]``, fp32 and contiguous. A step of one decode token runs on one thread: its
        attention (SmolLM2, 512 tokens of context, 2 threads) took 2.4 ms on one thread and 6-7 ms split over two,
        where 2 rows on two threads took 2.6 ms against 4.2 on one. One row of a few tokens (drafts to verify) is
        split over the threads by its blocks (the kernel's sweep)."""
        _, h, d = query.shape
        _, bs, kvh, _ = key_cache.shape
        tables, lens, starts = _i32(meta.block_tables), _i32(meta.seq_lens), _i32(meta.query_start_loc)
        s = tables.shape[0]
        self.fn(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            starts.data_ptr(),
            out.data_ptr(),
            s,
            h,
            kvh,
            d,
            bs,
            tables.shape[1],
            scale,
            threads or (1 if s == 1 and query.shape[0] <= ONE_THREAD_TOKENS else torch.get_num_threads()),
        )


_REFERENCE_ROPE_AND_CACHE = reference.rope_then(reference.reshape_and_cache)  # where the C entry does not fit


@dataclass(frozen=True, slots=True)
class RopeAndCache:
    """``cpu/attention.cpp``'s ``rope_and_cache_f32``, loaded: the backend's ``rope_and_cache``."""

    fn: ctypes._CFuncPtr  # type: ignore[name-defined]

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """``q [T, H, D]`` rotated in place (returned), ``k``/``v [T, KVH, D]`` (k rotated) written into their slots;
        ``cos``/``sin_signed`` ``[T, D]`` (any shape of those elements). The reference's ``rope_and_cache`` where
        the tensors do not fit (not fp32 on CPU, or rows not dense)."""
        t, h, d = q.shape
        kvh = k.shape[1]
        tensors = (q, k, v, cos, sin_signed, key_cache, value_cache)
        if not all(x.dtype == torch.float32 and x.device.type == "cpu" for x in tensors) or not all(
            x.stride(-1) == 1 and x.stride(-2) == d for x in (q, k, v)
        ):
            return _REFERENCE_ROPE_AND_CACHE(q, k, v, cos, sin_signed, key_cache, value_cache, slot_mapping)
        cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        self.fn(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            cos.data_ptr(),
            sin_signed.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slots.contiguous().data_ptr(),
            t,
            h,
            kvh,
            d,
            q.stride(0),
            k.stride(0),
            v.stride(0),
        )
        return q


def symbol(cache_dir: Path, name: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """``name`` from the library, compiled into ``cache_dir/kernels`` unless a build for this source, these flags
    and this CPU is there already."""
    lib = library_path(cache_dir)
    if not lib.exists():
        compile_library(lib, [*FLAGS, *map(str, SOURCES)])
    try:
        fn = getattr(ctypes.CDLL(str(lib)), name)
    except (OSError, AttributeError) as e:
        raise KernelUnavailable(f"cannot load {name} from {lib}: {e}") from e
    fn.restype = None
    return fn


def build(cache_dir: Path) -> Kernel:
    """The attention kernel."""
    fn = symbol(cache_dir, "paged_attention_f32")
    fn.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int32]
    return Kernel(fn)


def build_rope_and_cache(cache_dir: Path) -> RopeAndCache:
    """The rotary-and-cache entry."""
    fn = symbol(cache_dir, "rope_and_cache_f32")
    fn.argtypes = [_P] * 8 + [_I] * 7
    return RopeAndCache(fn)


def _fits(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    return (
        query.dtype == key_cache.dtype == value_cache.dtype == torch.float32
        and query.device.type == "cpu"
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    )


def attention(kernel: Kernel) -> reference.AttentionFn:
    """The backend's ``paged_attention``: every row through ``kernel`` (anything not fp32 on CPU through the
    reference)."""

    def paged_attention(
        query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: PagedMetadata, scale: float
    ) -> torch.Tensor:
        if not _fits(query, key_cache, value_cache):
            return reference.paged_attention(query, key_cache, value_cache, meta, scale)
        out = torch.empty(query.shape, dtype=query.dtype)
        kernel(query.contiguous(), key_cache, value_cache, meta, scale, out)
        return out

    return paged_attention
