"""Paged-KV operations behind one interface: Triton kernels on CUDA; on CPU a compiled decode kernel
(``cpu_attention.py``) beside the torch reference.

The executor asks for a backend once (``get_backend``) and the model code only
ever calls its three functions, so it never knows which implementation runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_kernels import cpu_attention, reference
from paged_kernels.reference import PagedMetadata, make_metadata, slot_mapping_for

__all__ = ["Backend", "PagedMetadata", "get_backend", "make_metadata", "slot_mapping_for"]

BACKENDS = ("auto", "triton", "cpu", "torch")


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    paged_attention: Callable[..., torch.Tensor]
    reshape_and_cache: Callable[..., None]
    copy_blocks: Callable[..., None]
    fallback: str = ""  # why ``auto`` did not give the compiled CPU kernel (empty: it did, or was not asked)


def get_backend(name: str, device: torch.device, cache_dir: Path | None = None) -> Backend:
    """``auto`` means Triton on CUDA, and elsewhere the compiled CPU decode kernel (built into
    ``cache_dir``), or the torch reference where it cannot be built (``fallback`` says why); ``cpu``
    insists on the kernel (``cpu_attention.KernelUnavailable`` where it cannot be built)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu" if cache_dir is not None else "torch"
        if name == "cpu":
            assert cache_dir is not None
            try:
                return _cpu(cpu_attention.build(cache_dir))
            except cpu_attention.KernelUnavailable as e:
                return _torch(f"the CPU decode kernel is not available: {e}")
    if name == "triton":
        from paged_kernels import triton_ops

        return Backend("triton", triton_ops.paged_attention, triton_ops.reshape_and_cache, triton_ops.copy_blocks)
    if name == "cpu":
        if cache_dir is None:
            raise ValueError("the cpu attention backend needs a cache directory to build its kernel in")
        return _cpu(cpu_attention.build(cache_dir))
    return _torch()


def _cpu(kernel: cpu_attention.Kernel) -> Backend:
    return Backend("cpu", cpu_attention.attention(kernel), reference.reshape_and_cache, reference.copy_blocks)


def _torch(fallback: str = "") -> Backend:
    return Backend("torch", reference.paged_attention, reference.reshape_and_cache, reference.copy_blocks, fallback)
