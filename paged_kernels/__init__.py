"""Paged-KV operations behind one interface: Triton kernels on CUDA, a compiled kernel on CPU
(``cpu_attention.py``), the torch reference where that cannot be built.

The executor asks for a backend once (``get_backend``) and the model code only
ever calls its three functions, so it never knows which implementation runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_kernels import cpu_attention, cpu_build, cpu_race, reference
from paged_kernels.reference import PagedMetadata, make_metadata, slot_mapping_for

__all__ = ["Backend", "PagedMetadata", "get_backend", "make_metadata", "slot_mapping_for"]

BACKENDS = ("auto", "triton", "cpu", "torch")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    paged_attention: Callable[..., torch.Tensor]
    reshape_and_cache: Callable[..., None]
    copy_blocks: Callable[..., None]
    # q and k rotated, k and v cached, in one call (the lean forward's): -> rotated q
    rope_and_cache: Callable[..., torch.Tensor]
    # whole-vocabulary sampled rows in one compiled pass (scaled logits, keys) -> tokens; None: the sampler's torch draw
    race: cpu_race.Draw | None = None

    @classmethod
    def of(
        cls,
        name: str,
        paged_attention: Callable[..., torch.Tensor],
        reshape_and_cache: Callable[..., None],
        copy_blocks: Callable[..., None],
        rope_and_cache: Callable[..., torch.Tensor] | None = None,
        race: cpu_race.Draw | None = None,
    ) -> Backend:
        """A backend; without a fused ``rope_and_cache`` of its own, the reference rotary, then its own writes."""
        fused = rope_and_cache or reference.rope_then(reshape_and_cache)
        return cls(name, paged_attention, reshape_and_cache, copy_blocks, fused, race)


def get_backend(name: str, device: torch.device, cache_dir: Path | None = None) -> Backend:
    """``auto`` means Triton on CUDA and the compiled kernel on CPU (built into ``cache_dir``), or the torch
    reference where it cannot be built (the reason logged); ``cpu`` asked for by name raises
    ``cpu_build.KernelUnavailable`` with the reason instead."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto" and device.type == "cuda":
        name = "triton"
    if name == "triton":
        from paged_kernels import triton_ops

        return Backend.of("triton", triton_ops.paged_attention, triton_ops.reshape_and_cache, triton_ops.copy_blocks)
    if name in ("cpu", "auto"):
        if cache_dir is None:
            raise ValueError("the cpu attention backend needs a cache directory to build its kernel in")
        try:
            kernel = cpu_attention.build(cache_dir)
            rope_and_cache = cpu_attention.build_rope_and_cache(cache_dir)
            race = cpu_race.build(cache_dir)
        except cpu_build.KernelUnavailable as e:
            if name == "cpu":
                raise
            log.warning("attention: the cpu kernel is unavailable (%s); using the torch reference", e)
        else:
            attend = cpu_attention.attention(kernel)
            return Backend.of("cpu", attend, reference.reshape_and_cache, reference.copy_blocks, rope_and_cache, race)
    return Backend.of("torch", reference.paged_attention, reference.reshape_and_cache, reference.copy_blocks)
