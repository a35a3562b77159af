"""Paged-KV operations behind one interface: Triton kernels on CUDA, torch on CPU.

The executor asks for a backend once (``get_backend``) and the model code only
ever calls its three functions, so it never knows which implementation runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged_kernels.reference import PagedMetadata, make_metadata, slot_mapping_for

__all__ = ["Backend", "PagedMetadata", "get_backend", "make_metadata", "slot_mapping_for"]

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    paged_attention: Callable[..., torch.Tensor]
    reshape_and_cache: Callable[..., None]
    copy_blocks: Callable[..., None]


def get_backend(name: str, device: torch.device) -> Backend:
    """``auto`` means Triton on CUDA and the torch reference elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from paged_kernels import triton_ops

        return Backend("triton", triton_ops.paged_attention, triton_ops.reshape_and_cache, triton_ops.copy_blocks)
    from paged_kernels import reference

    return Backend("torch", reference.paged_attention, reference.reshape_and_cache, reference.copy_blocks)
