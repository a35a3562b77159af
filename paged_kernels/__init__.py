"""Paged-KV operations behind one interface: Triton kernels on CUDA, torch on CPU (and, on request, a
compiled kernel for short rows beside it, ``cpu_attention.py``).

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


def get_backend(name: str, device: torch.device, cache_dir: Path | None = None) -> Backend:
    """``auto`` means Triton on CUDA and the torch reference elsewhere; ``cpu`` is the compiled kernel for
    short rows beside the reference (built into ``cache_dir``; ``cpu_attention.KernelUnavailable`` says why
    where it cannot be). Not ``auto``'s choice on CPU: a token's attention then depends on whether its row
    was short, so a seeded request is not bit-for-bit the same after a preemption or a prefix-cache hit
    (``cpu_attention.py``)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from paged_kernels import triton_ops

        return Backend("triton", triton_ops.paged_attention, triton_ops.reshape_and_cache, triton_ops.copy_blocks)
    if name == "cpu":
        if cache_dir is None:
            raise ValueError("the cpu attention backend needs a cache directory to build its kernel in")
        kernel = cpu_attention.build(cache_dir)
        return Backend("cpu", cpu_attention.attention(kernel), reference.reshape_and_cache, reference.copy_blocks)
    return Backend("torch", reference.paged_attention, reference.reshape_and_cache, reference.copy_blocks)
