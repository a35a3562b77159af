"""The model's linear layers on CPU as prepacked oneDNN GEMMs (``--cpu-linear onednn``, the default on CPU).

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
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)
CHOICES = ("onednn", "torch")


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` reordered once for oneDNN (any leading dimensions of ``x``)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def prepack(model: nn.Module) -> int:
    """Swap ``model``'s fp32 linear layers for ``PackedLinear`` in place; how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 and child.weight.is_cpu:
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped


def apply(model: nn.Module, choice: str, device: torch.device) -> str:
    """The linear path ``choice`` asks for on ``device``; what runs (``torch`` where oneDNN can't)."""
    if choice != "onednn" or device.type != "cpu":
        return "torch"
    if not available():
        log.warning("--cpu-linear onednn: this torch build has no oneDNN linear; using torch's")
        return "torch"
    swapped = prepack(model)
    log.info("linear layers: %d prepacked for oneDNN", swapped)
    return "onednn" if swapped else "torch"
