"""The oneDNN linear path (executor_svc/linear.py) on its own: fused q/k/v and gate/up GEMMs give each layer the
product it would compute alone, whichever order the parts are called in, and a model keeps its outputs.

Plain torch on small random weights; no service. Closeness is asserted at fp32's scale, not bit equality: the GEMM's
summation order belongs to oneDNN and the machine, and greedy identity with transformers is the oracle tests' job.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from executor_svc import linear

pytestmark = pytest.mark.skipif(not linear.available(), reason="this torch build has no oneDNN linear")


def _layers(bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(64, n, bias=bias) for n in (64, 16, 16)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_each_part_of_a_fused_gemm_is_its_own_layers_product(bias: bool, rows: int) -> None:
    layers = _layers(bias)
    fused = linear.Fused(layers)
    parts = [linear.Part(lin, fused, i) for i, lin in enumerate(layers)]
    x = torch.randn(rows, 64)
    for part, lin in zip(parts, layers, strict=True):
        got = part(x)
        assert got.shape == (rows, lin.out_features) and got.is_contiguous()
        torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-6)
    assert fused.input is None  # every slice taken: nothing held until the next call


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


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_model_fused_and_packed_keeps_its_logits(kind: str) -> None:
    model = _tiny(kind)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        want = model(ids).logits
        assert linear.apply(model, "onednn", torch.device("cpu")) == "onednn"
        got = model(ids).logits
    parts = [m for m in model.modules() if isinstance(m, linear.Part)]
    assert len(parts) == 2 * (3 + 2)  # per layer: q/k/v, gate/up
    assert not any(type(m) is nn.Linear for m in model.model.modules())  # o_proj, down_proj: packed alone
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
