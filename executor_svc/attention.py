"""Paged attention plugged into transformers' attention interface.

``AttentionInterface.register`` lets every architecture that routes attention
through the interface (Llama, Qwen2, Mistral, ...) run on the paged pool without
copying model code. Per-step inputs travel as the ``paged`` keyword argument of
the forward call, which transformers hands to every attention layer: no global
state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from executor_svc.kv_pool import Tier
from paged_kernels import Backend, PagedMetadata

IMPLEMENTATION = "pagedserve"


@dataclass(slots=True)
class StepContext:
    meta: PagedMetadata
    cache: Tier
    backend: Backend


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    paged: StepContext | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """``query [1, H, T, D]``, ``key/value [1, KVH, T, D]`` post-RoPE, packed tokens."""
    if paged is None:
        raise RuntimeError("the pagedserve attention needs the step's `paged` context")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_cache, v_cache = paged.cache.k[layer], paged.cache.v[layer]
    q = query[0].transpose(0, 1)  # [T, H, D]
    paged.backend.reshape_and_cache(
        key[0].transpose(0, 1).contiguous(),
        value[0].transpose(0, 1).contiguous(),
        k_cache,
        v_cache,
        paged.meta.slot_mapping,
    )
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = paged.backend.paged_attention(q, k_cache, v_cache, paged.meta, scale)
    return out[None], None


def _no_mask(*_: object, **__: object) -> None:
    """Causality and sequence boundaries come from the paged metadata, not a dense mask."""
    return None


AttentionInterface.register(IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
