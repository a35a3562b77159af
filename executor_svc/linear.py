"""The model's linear layers on CPU as prepacked oneDNN GEMMs (``--cpu-linear auto``, the default on CPU).

torch's ``F.linear`` in fp32 on CPU calls MKL's sgemm on the weight as stored, ``[out, in]``, transposed on the fly.
A decode step multiplies a handful of rows by every weight of the model once, and for such short, wide products a
weight reordered once into oneDNN's blocked layout for the machine's vector width is read far faster: on this 2-core
VM, one thread, SmolLM2's decode step at batch 8 took ~0.5x the time, at batch 32 ~0.6x, at batch 1 ~0.85x (the
output projection over the 49,152-token vocabulary is the largest single product). vLLM's CPU backend does the same
(``dispatch_cpu_unquantized_gemm``: ``onednn_mm`` on weights packed at load).

``prepack`` swaps every ``nn.Linear`` for a ``PackedLinear`` holding the reordered copy; a weight tied to the input
embeddings (SmolLM2's output projection) stays for the embedding lookup, the others are released. The result differs
from MKL's in the last bits of fp32 (another summation order), as any GEMM library's does; greedy output stays
token-identical to transformers' in the oracle tests (``tests/test_e2e_oracle.py``), which run this path on CPU.

``fuse`` then packs the products that read the same input one after the other (an attention's q/k/v, an MLP's
gate/up) into one GEMM each, as vLLM's ``QKVParallelLinear``/``MergedColumnParallelLinear`` do: 4 calls a layer
instead of 7. Each output column is still the dot product of the same row with the same weight row, and oneDNN's
reduction over the input features does not depend on how many columns a call has: the fused slices equal the separate
products bit for bit (``tests/unit/executor_svc/test_linear.py`` checks it, at AVX2 and at the machine's widest ISA).

Two ways to reach oneDNN (``--cpu-linear``): ``dnnl`` calls oneDNN's own release through a small shim
(``paged_kernels/cpu_linear.py``: no dispatcher, primitives cached by row count, as vLLM's ``onednn_mm``; a decode
step's products 13-22% faster than ``onednn`` on a 2-core AVX2 VM); ``onednn`` goes through torch
(``torch.ops.mkldnn``, ideep); ``auto`` takes ``dnnl`` where it builds, else ``onednn``; ``torch`` keeps ``F.linear``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from executor_svc import model_store
from paged_kernels import cpu_linear
from paged_kernels.cpu_build import KernelUnavailable

log = logging.getLogger(__name__)
CHOICES = ("auto", "dnnl", "onednn", "torch")

# (weight [out, in], bias) -> x -> x W^T + b, the weight packed once: TorchOneDNN or paged_kernels.cpu_linear.Gemm
Packer = Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class TorchOneDNN:
    """``W`` reordered once by torch's oneDNN (ideep), multiplied through ``torch.ops.mkldnn``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` reordered once for oneDNN (any leading dimensions of ``x``)."""

    def __init__(self, linear: nn.Linear, pack: Packer = TorchOneDNN) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gemm = pack(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {type(self.gemm).__name__}"


class Fused:
    """One packed GEMM whose output columns are several layers' outputs; ``Part`` i hands out slice i.

    The model calls the parts one after the other on the same input tensor (transformers' Llama and Qwen2 call
    ``q_proj``, ``k_proj``, ``v_proj`` on the same ``hidden_states``, then ``gate_proj`` and ``up_proj``). The first
    part's call computes the whole product; the others take their slice of it while the input is the same object.
    A part called on another input (a model that calls them otherwise) computes the product again: still right.
    """

    def __init__(self, linears: list[nn.Linear], pack: Packer = TorchOneDNN) -> None:
        weight = torch.cat([lin.weight.detach() for lin in linears])
        biases = [lin.bias for lin in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
        self.gemm = pack(weight, bias)
        self.sizes = [lin.out_features for lin in linears]
        self.input: torch.Tensor | None = None
        self.outputs: list[torch.Tensor | None] = []

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The whole product: every part's output, side by side in ``sizes`` columns."""
        return self.gemm(x)

    def take(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if x is not self.input or self.outputs[i] is None:
            y = self.product(x)
            # contiguous copies: elementwise kernels take another (vectorised or not) path on strided views
            self.input, self.outputs = x, [t.contiguous() for t in y.split(self.sizes, dim=-1)]
        out, self.outputs[i] = self.outputs[i], None
        if all(o is None for o in self.outputs):
            self.input = None  # every part has taken its slice: hold nothing between calls
        assert out is not None
        return out


class Part(PackedLinear):
    """Output slice ``index`` of a ``Fused`` product, where a model expects its own linear layer."""

    def __init__(self, linear: nn.Linear, fused: Fused, index: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fused, self.index = fused, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.take(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.index} of a fused GEMM"


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # called in this order on one input


def fuse(model: nn.Module, pack: Packer = TorchOneDNN) -> int:
    """Swap each group of ``GROUPS`` (fp32 CPU ``nn.Linear``s of one module, same input size, all with or all
    without bias) for ``Part``s of one ``Fused`` GEMM; how many groups were fused."""
    fused = 0
    for parent in list(model.modules()):
        for names in GROUPS:
            layers = [getattr(parent, n, None) for n in names]
            if not all(isinstance(lin, nn.Linear) for lin in layers):
                continue
            lins = [lin for lin in layers if isinstance(lin, nn.Linear)]
            fits = all(lin.weight.dtype == torch.float32 and lin.weight.is_cpu for lin in lins)
            if not fits or len({lin.in_features for lin in lins}) != 1 or len({lin.bias is None for lin in lins}) != 1:
                continue
            group = Fused(lins, pack)
            for i, (name, lin) in enumerate(zip(names, lins, strict=True)):
                setattr(parent, name, Part(lin, group, i))
            fused += 1
    return fused


def prepack(model: nn.Module, pack: Packer = TorchOneDNN) -> int:
    """Swap ``model``'s fp32 linear layers for ``PackedLinear`` in place; how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 and child.weight.is_cpu:
                setattr(parent, name, PackedLinear(child, pack))
                swapped += 1
    return swapped


def packer(choice: str, cache_dir: Path) -> tuple[str, Packer | None]:
    """What ``choice`` runs here, and how it packs a weight (None: ``F.linear``). ``dnnl`` asked for by name raises
    ``KernelUnavailable`` where its shim cannot be built or loaded; ``auto`` then takes ``onednn`` (the reason
    logged)."""
    if choice not in CHOICES:
        raise ValueError(f"cpu_linear must be one of {CHOICES}, got {choice!r}")
    if choice in ("auto", "dnnl"):
        try:
            lib = cpu_linear.load(cache_dir)
            return "dnnl", lambda weight, bias: cpu_linear.Gemm(lib, weight, bias)
        except KernelUnavailable as exc:
            if choice == "dnnl":
                raise
            log.warning("--cpu-linear auto: oneDNN's own library is unavailable (%s); using torch's", exc)
        choice = "onednn"
    if choice == "onednn" and available():
        return "onednn", TorchOneDNN
    if choice == "onednn":
        log.warning("--cpu-linear onednn: this torch build has no oneDNN linear; using torch's")
    return "torch", None


def apply(model: nn.Module, choice: str, device: torch.device, cache_dir: Path | None = None) -> str:
    """The linear path ``choice`` asks for on ``device`` (``dnnl``'s shim built into ``cache_dir``, by default
    ``model_store.cache_dir()``); what runs (``torch`` off the CPU, or where oneDNN can't)."""
    if device.type != "cpu":
        return "torch"
    name, pack = packer(choice, cache_dir or model_store.cache_dir())
    if pack is None:
        return "torch"
    groups = fuse(model, pack)
    swapped = prepack(model, pack)
    log.info("linear layers (%s): %d groups fused, %d more prepacked for oneDNN", name, groups, swapped)
    return name if swapped or groups else "torch"
