"""The oneDNN linear paths (executor_svc/linear.py) on their own, torch's (``onednn``) and oneDNN's own library
called directly (``dnnl``, paged_kernels/cpu_linear.py): fused q/k/v and gate/up GEMMs give each layer the product it
would compute alone, whichever order the parts are called in, and a model keeps its outputs.

Plain torch on small random weights; no service. Against ``F.linear`` closeness is asserted at fp32's scale, not bit
equality: the GEMM's summation order belongs to oneDNN and the machine, and greedy identity with transformers is the
oracle tests' job. Within one path, a row's product is bit for bit the same whatever else the call holds (other rows,
other layers' columns): that is what makes fused slices exact and a token's logits independent of its batch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from executor_svc import linear
from paged_kernels import cpu_linear
from paged_kernels.cpu_build import KernelUnavailable

pytestmark = pytest.mark.skipif(not linear.available(), reason="this torch build has no oneDNN linear")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh cache directory: the ``dnnl`` shim is built there once for this module (the build is under test)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def dnnl(kernels: Path) -> linear.Packer:
    """The ``dnnl`` path's packer."""
    name, pack = linear.packer("dnnl", kernels)
    assert name == "dnnl" and pack is not None
    return pack


@pytest.fixture(params=["onednn", "dnnl"])
def pack(request: pytest.FixtureRequest) -> linear.Packer:
    return linear.TorchOneDNN if request.param == "onednn" else request.getfixturevalue("dnnl")


def _layers(bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(64, n, bias=bias) for n in (64, 16, 16)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_each_part_of_a_fused_gemm_is_its_own_layers_product(pack: linear.Packer, bias: bool, rows: int) -> None:
    layers = _layers(bias)
    fused = linear.Fused(layers, pack)
    parts = [linear.Part(lin, fused, i) for i, lin in enumerate(layers)]
    x = torch.randn(rows, 64)
    for part, lin in zip(parts, layers, strict=True):
        got = part(x)
        assert got.shape == (rows, lin.out_features) and got.is_contiguous()
        torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-6)
        assert torch.equal(got, linear.PackedLinear(lin, pack)(x)), "a fused slice is the layer's own product"
    assert fused.input is None  # every slice taken: nothing held until the next call


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (4096, 576)])
def test_a_rows_product_does_not_depend_on_the_other_rows(pack: linear.Packer, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(*shape, generator=gen) * 0.05, torch.randn(40, shape[1], generator=gen)
    gemm = pack(weight, None)
    alone = torch.cat([gemm(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 7, 16, 33, 40):
        assert torch.equal(gemm(x[:rows]), alone[:rows]), rows
    torch.testing.assert_close(alone, x @ weight.T, rtol=1e-4, atol=1e-4)


def test_the_dnnl_path_takes_leading_dimensions_strided_inputs_and_no_rows(dnnl: linear.Packer) -> None:
    lin = _layers(True)[0]
    gemm = dnnl(lin.weight.detach(), lin.bias.detach())
    x = torch.randn(2, 3, 128)[..., ::2]  # [2, 3, 64], not contiguous
    got = gemm(x)
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got, lin(x).detach(), rtol=1e-5, atol=1e-6)
    assert gemm(torch.empty(0, 64)).shape == (0, 64)


def test_a_refused_dnnl_call_raises_with_onednns_reason(kernels: Path) -> None:
    lib = cpu_linear.load(kernels)
    handle, size = ctypes.c_void_p(), ctypes.c_int64()
    with pytest.raises(RuntimeError, match="oneDNN"):  # a C++ exception in the shim, not a crash
        lib.new(-1, 4, ctypes.byref(handle), ctypes.byref(size))
    assert handle.value is None


def test_auto_falls_back_to_torchs_onednn_and_dnnl_by_name_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Isolates the choice: the shim's loader stands in for a machine without oneDNN (the real build is tested above).
    def missing(cache_dir: Path) -> cpu_linear.Library:
        raise KernelUnavailable("oneDNN's headers and library are not here")

    monkeypatch.setattr(cpu_linear, "load", missing)
    assert linear.packer("auto", tmp_path) == ("onednn", linear.TorchOneDNN)
    with pytest.raises(KernelUnavailable, match="not here"):
        linear.packer("dnnl", tmp_path)
    assert linear.packer("torch", tmp_path) == ("torch", None)
    with pytest.raises(ValueError, match="cpu_linear"):
        linear.packer("mkl", tmp_path)


def test_parts_called_out_of_order_or_on_new_inputs_still_compute_their_own() -> None:
    layers = _layers(False)
    fused = linear.Fused(layers)
    q, k, v = (linear.Part(lin, fused, i) for i, lin in enumerate(layers))
    a, b = torch.randn(3, 64), torch.randn(3, 64)
    torch.testing.assert_close(k(a), layers[1](a), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q(b), layers[0](b), rtol=1e-5, atol=1e-6)  # another input: computed anew
    torch.testing.assert_close(v(b), layers[2](b), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v(b), layers[2](b), rtol=1e-5, atol=1e-6)  # taken twice: computed again


def _tiny(kind: str) -> nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    if kind == "qwen2":  # q/k/v with bias, o without: fused groups must agree on bias
        return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **common)).eval()
    return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **common)).eval()


@pytest.mark.parametrize("choice", ["onednn", "dnnl"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_model_fused_and_packed_keeps_its_logits(kind: str, choice: str, kernels: Path) -> None:
    model = _tiny(kind)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        want = model(ids).logits
        assert linear.apply(model, choice, torch.device("cpu"), kernels) == choice
        got = model(ids).logits
    parts = [m for m in model.modules() if isinstance(m, linear.Part)]
    assert len(parts) == 2 * (3 + 2)  # per layer: q/k/v, gate/up
    assert not any(type(m) is nn.Linear for m in model.model.modules())  # o_proj, down_proj: packed alone
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
