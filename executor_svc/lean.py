"""A lean forward pass for the Llama family (``--model-impl``): the same arithmetic as transformers' eager model in
far fewer Python-dispatched ops.

A decode step's tensors are tiny, so its time goes to dispatch as much as to arithmetic: transformers' eager Llama
spends ~40 small torch ops a layer (RMSNorm as pow/mean/add/rsqrt/mul/to, rotary as mul/slice/neg/cat/add for q and
k, the ``[B, H, T, D]`` transposes, the attention interface's glue) inside four nested module calls. A SmolLM2-135M
decode step on the executor dispatched ~2,050 top-level aten ops that way, ~1,020 this way (a third of them the
backend's ``reshape_and_cache``), besides the 121 linear products; the Python time between them is serial, and the
second OpenMP core idles through it. On 2 CPU cores the decode step takes ~0.83x transformers' time at batch 1 (~4 ms
less), ~0.9x at batch 32, a prefill ~0.95x. This module runs the packed ``[T, hidden]`` tokens through the layers:

- RMSNorm is ``F.rms_norm`` (one op) where it gives transformers' ``LlamaRMSNorm`` bits on this device and dtype
  (checked once, at construction), transformers' formula otherwise.
- Rotary: ``cos``/``sin`` come from the model's own ``rotary_emb`` once a step (any ``rope_scaling``); then
  ``x*cos + rotate_half(x)*sin`` as ``x*cos + roll(x, D/2) * (sin with its first half negated)``
  (``paged_kernels.reference.rope``): the same products and sums, element for element, hence the same bits. The
  backend's ``rope_and_cache`` rotates q and k and writes k and v into the cache: on the cpu backend one C call a
  layer where torch took ~19 ops, with the same bits.
- Attention calls the step's paged backend as ``attention.paged_attention_forward`` does.
- q/k/v and gate/up are one call each of their fused GEMM (``linear.Fused``), the outputs column views of its product
  (``Project``), where nothing hooks the parts; with LoRA's forward hooks (``lora.py``) the modules are called, in
  order, on one input. Every other linear layer (and the embedding) is called as the module it is.

Greedy output is token-identical to transformers' and the logits equal the transformers path's on the same executor
(``tests/unit/executor_svc/test_lean.py``). A model this does not cover keeps transformers' forward (``supports``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from executor_svc import linear
from executor_svc.attention import StepContext

CHOICES = ("auto", "lean", "transformers")
log = logging.getLogger(__name__)
ARCHITECTURES: dict[str, type[nn.Module]] = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def supports(model: nn.Module) -> str | None:
    """None where ``LeanForward`` computes what ``model``'s own forward does; otherwise why not.

    Biases (Llama's ``attention_bias``/``mlp_bias``, Qwen2's q/k/v bias) live in the linear modules, which the lean
    forward calls: they need no check.
    """
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    arch = ARCHITECTURES.get(str(model_type))
    if config is None or arch is None:
        return f"model type {model_type!r} is not one of {sorted(ARCHITECTURES)}"
    if type(model) is not arch:
        return f"{type(model).__name__} is not transformers' {arch.__name__}"
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} are not all full_attention"
    return None


def choose(model: nn.Module, impl: str) -> LeanForward | None:
    """The forward ``impl`` (``--model-impl``) asks for: a ``LeanForward``, or None for transformers' own. ``auto``
    takes the lean one where ``supports`` allows; ``lean`` on a model it does not support is a ValueError."""
    if impl not in CHOICES:
        raise ValueError(f"model_impl must be one of {CHOICES}, got {impl!r}")
    if impl == "transformers":
        return None
    reason = supports(model)
    if reason is None:
        forward = LeanForward(model)
        log.info("model: the lean forward (executor_svc/lean.py; RMSNorm by %s)", forward.norm.__name__)
        return forward
    if impl == "lean":
        raise ValueError(f"--model-impl lean: {reason}")
    log.info("model: transformers' forward; the lean one does not support this model (%s)", reason)
    return None


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``/``Qwen2RMSNorm``, op for op."""
    x32 = x.to(torch.float32)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def pick_norm(hidden: int, eps: float, device: torch.device, dtype: torch.dtype) -> Norm:
    """``fused_rms_norm`` where it gives ``hf_rms_norm``'s bits on this device and dtype (random weights and rows,
    one row and many, as at decode and prefill), ``hf_rms_norm`` otherwise (e.g. bfloat16, where transformers
    rounds before the weight's product). A local generator: the global RNG stays as it was."""
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 37):
        x, w = ((torch.randn(n, generator=gen) * 3).to(device, dtype) for n in ((rows, hidden), (hidden,)))
        if not torch.equal(fused_rms_norm(x, w, eps), hf_rms_norm(x, w, eps)):
            return hf_rms_norm
    return fused_rms_norm


@dataclass(frozen=True, slots=True)
class Project:
    """``x -> [m(x) for m in modules]`` for modules called on one input: q/k/v, gate/up. Where they are the parts of
    one fused GEMM (``linear.Fused``, in order) and nothing hooks them (no LoRA), one call of that GEMM, and the outputs
    are column views of its product: no module calls, no copies (the C kernels read strided rows)."""

    modules: tuple[nn.Module, ...]
    fused: linear.Fused | None

    @classmethod
    def of(cls, *modules: nn.Module) -> Project:
        parts = [m for m in modules if isinstance(m, linear.Part) and not (m._forward_hooks or m._forward_pre_hooks)]
        fused = parts[0].fused if parts and len(parts) == len(modules) else None
        if fused is None or [(p.fused, p.index) for p in parts] != [(fused, i) for i in range(len(fused.sizes))]:
            return cls(modules, None)
        return cls(modules, fused)

    def __call__(self, x: torch.Tensor) -> Sequence[torch.Tensor]:
        if self.fused is not None:
            return self.fused.product(x).split(self.fused.sizes, dim=-1)
        return [m(x) for m in self.modules]


@dataclass(frozen=True, slots=True)
class Layer:
    """One decoder layer's modules and norm weights, as the lean forward uses them."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Project
    o_proj: nn.Module
    gate_up: Project
    down_proj: nn.Module

    @classmethod
    def of(cls, layer: Any) -> Layer:  # a transformers decoder layer (its submodules are untyped)
        attn, mlp = layer.self_attn, layer.mlp
        return cls(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            Project.of(attn.q_proj, attn.k_proj, attn.v_proj),
            attn.o_proj,
            Project.of(mlp.gate_proj, mlp.up_proj),
            mlp.down_proj,
        )


@dataclass(frozen=True, slots=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # the attention modules' ``scaling``
    eps: float


@dataclass(frozen=True, slots=True)
class Step:
    """What every layer of one forward shares: the rotary tables and the paged attention's context."""

    cos: torch.Tensor  # [T, 1, D]
    sin_signed: torch.Tensor  # [T, 1, D], rotate_half's sign on its first half (``rope``)
    ctx: StepContext


class LeanForward:
    """``model``'s forward over packed tokens on the paged KV pool. Build it after ``linear.apply`` and LoRA's
    ``Adapters``: it keeps the modules the model holds then, and calls them."""

    def __init__(self, model: nn.Module) -> None:
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"the lean forward does not support this model: {reason}")
        hf: Any = model  # transformers' module tree: its attributes are untyped
        config, body = hf.config, hf.model
        attn = body.layers[0].self_attn
        self.shape = Shape(
            config.num_attention_heads,
            config.num_key_value_heads,
            attn.head_dim,
            attn.scaling,
            body.norm.variance_epsilon,
        )
        self.embed_tokens: nn.Module = body.embed_tokens
        self.rotary_emb: nn.Module = body.rotary_emb
        self.lm_head: nn.Module = hf.lm_head
        self.final_norm: torch.Tensor = body.norm.weight
        self.layers = [Layer.of(layer) for layer in body.layers[: config.num_hidden_layers]]
        weight = self.final_norm
        self.norm = pick_norm(weight.shape[0], self.shape.eps, weight.device, weight.dtype)
        self.sign = torch.ones(self.shape.head_dim, dtype=weight.dtype, device=weight.device)
        self.sign[: self.shape.head_dim // 2] = -1

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` long, ``keep`` the packed positions to return logits for:
        ``[len(keep), vocab]``. The final norm runs on the kept rows only (a row's norm is its own)."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(h, positions[None])  # [1, T, D], as the model's own forward computes them
        step = Step(cos[0, :, None], (sin[0] * self.sign)[:, None], ctx)
        for layer, k_cache, v_cache in zip(self.layers, ctx.cache.k.unbind(0), ctx.cache.v.unbind(0)):
            h = self._layer(layer, h, step, k_cache, v_cache)
        return self.lm_head(self.norm(h.index_select(0, keep), self.final_norm, self.shape.eps))

    def _layer(
        self, layer: Layer, h: torch.Tensor, step: Step, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """One decoder layer. ``h``, the residual stream, is this forward's own tensor (the embedding's output,
        then the sums): updated in place."""
        s, t = self.shape, h.shape[0]
        x = self.norm(h, layer.attn_norm, s.eps)
        q, k, v = layer.qkv(x)  # one fused GEMM (linear.py), or the three modules (LoRA's hooks)
        q, k, v = q.view(t, s.heads, s.head_dim), k.view(t, s.kv_heads, s.head_dim), v.view(t, s.kv_heads, s.head_dim)
        # As attention.paged_attention_forward, with the rotary first: write this step's K/V, then attend over the
        # paged context. The cpu backend does the rotary and the writes in one call (paged_kernels.reference.rope).
        ctx = step.ctx
        q = ctx.backend.rope_and_cache(q, k, v, step.cos, step.sin_signed, k_cache, v_cache, ctx.meta.slot_mapping)
        out = ctx.backend.paged_attention(q, k_cache, v_cache, ctx.meta, s.scale)
        h.add_(layer.o_proj(out.reshape(t, -1)))
        x = self.norm(h, layer.mlp_norm, s.eps)
        gate, up = layer.gate_up(x)
        return h.add_(layer.down_proj(F.silu(gate).mul_(up)))
