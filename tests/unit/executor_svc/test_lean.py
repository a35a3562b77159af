"""The lean forward (``executor_svc/lean.py``) against transformers' forward on the executor's engine: the same
logits bit for bit (``torch.equal``) and the same KV pool, over prefill chunks, prompt logprobs, drafts and decodes,
on the tiny Llama and Qwen2, a Llama with every option the lean path reads (biases, a head_dim of its own, llama3
rope scaling, random norm weights) in fp32 and bf16, and with LoRA adapters on; greedy decoding equals transformers'
``generate``; and a model it does not cover keeps transformers' forward, or is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from executor_svc import lean
from executor_svc.engine import Engine, EngineConfig
from executor_svc.lora import LoraConfig
from executor_svc.plan import LoraRef, SeqInput, StepInput
from pagedserve import lora
from tests.conftest import save_model
from tests.helpers import block_bytes
from tests.lora_support import make_adapter

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    """Biases on every linear layer, head_dim 32 beside hidden 64 / 4 heads, llama3 rope scaling, norm weights
    that are not ones (F.rms_norm's bits must match transformers' for the weights too)."""
    torch.manual_seed(3)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = LlamaForCausalLM(LlamaConfig(**heads, attention_bias=True, mlp_bias=True, rope_parameters=rope, **TINY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.5)
    return save_model(model, tmp_path_factory.mktemp("odd-llama"), smol_dir)


def engine(model: Path, impl: str, **kw: Any) -> Engine:
    return Engine(EngineConfig(model, kv_cache_memory=8 * block_bytes(model), device="cpu", model_impl=impl, **kw))


def steps(ref: LoraRef | None = None) -> list[list[SeqInput]]:
    """A prefill step (a chunk with prompt logprobs, a short prompt, a chunk that samples nothing), then a step
    with a decode, drafts to verify and the rest of a chunk, then decodes. ``ref``: "b" and "c" run on it."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 49152, (n,), generator=g).tolist()

    return [
        [
            SeqInput("a", ids(20), 0, [0, 1], prompt_logprobs=0),
            SeqInput("b", ids(5), 0, [2], lora=ref),
            SeqInput("c", ids(17), 0, [3, 4], sample=False, lora=ref),
        ],
        [
            SeqInput("a", ids(1), 20, [0, 1]),
            SeqInput("b", ids(3), 5, [2], num_drafts=2, lora=ref),
            SeqInput("c", ids(4), 17, [3, 4], lora=ref),
        ],
        [SeqInput("a", ids(1), 21, [0, 1]), SeqInput("b", ids(1), 8, [2], lora=ref), SeqInput("c", ids(1), 21, [3, 4])],
    ]


def forward(e: Engine, seqs: list[SeqInput]) -> torch.Tensor:
    """The logits of one step's kept rows, as ``Engine.step`` computes them before sampling."""
    for s in seqs:
        e._check(s)
    if e.adapters is not None:
        e.adapters.begin(seqs)
    try:
        logits, _ = e._forward(seqs, e.tables.stacked([s.request_id for s in seqs]))
    finally:
        if e.adapters is not None:
            e.adapters.end()
    assert logits is not None
    return logits


def assert_same(model: Path, ref: LoraRef | None = None, **kw: Any) -> list[torch.Tensor]:
    """Both implementations over ``steps``: equal logits at every step and equal KV pools after them."""
    hf, ours = engine(model, "transformers", **kw), engine(model, "lean", **kw)
    assert hf.lean is None and ours.lean is not None
    out = []
    for i, seqs in enumerate(steps(ref)):
        want, got = forward(hf, seqs), forward(ours, steps(ref)[i])
        assert torch.equal(got, want), f"step {i}: max |diff| {float((got.float() - want.float()).abs().max())}"
        out.append(got)
    assert torch.equal(ours.pool.device.k, hf.pool.device.k) and torch.equal(ours.pool.device.v, hf.pool.device.v)
    return out


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("linear", ["onednn", "torch"])
def test_logits_equal_transformers(arch: str, backend: str, linear: str, request: pytest.FixtureRequest) -> None:
    assert_same(request.getfixturevalue(arch), attention_backend=backend, cpu_linear=linear)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_equal_with_biases_head_dim_rope_scaling_and_norm_weights(odd_llama: Path, dtype: str) -> None:
    assert lean.supports(AutoModelForCausalLM.from_pretrained(odd_llama)) is None
    assert_same(odd_llama, dtype=dtype)


def test_logits_equal_with_lora_adapters(tiny_llama: Path, tmp_path: Path) -> None:
    path = make_adapter(tiny_llama, tmp_path / "adapter", seed=7, r=4)
    ref = LoraRef(lora.read("a", str(path), 8).digest, str(path), "a")
    on_adapter = assert_same(tiny_llama, ref, lora=LoraConfig(max_loras=2, max_lora_rank=8))
    base = assert_same(tiny_llama)
    assert not torch.equal(on_adapter[1], base[1]), "the adapter's hooks ran on the lean path"


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_greedy_equals_generate(arch: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(arch)
    prompt = torch.randint(3, 49152, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        want = hf.generate(torch.tensor([prompt]), attention_mask=mask, max_new_tokens=12, do_sample=False)
    e = engine(model, "auto")
    assert e.lean is not None
    table = [0, 1, 2]
    tokens = prompt + [e.step(StepInput(seqs=[SeqInput("g", prompt, 0, table)])).tokens[0][1]]
    for _ in range(11):
        out = e.step(StepInput(seqs=[SeqInput("g", tokens[-1:], len(tokens) - 1, table)]))
        tokens.append(out.tokens[0][1])
    assert tokens == want[0].tolist()


def test_unsupported_models_give_a_reason(tiny_qwen2: Path) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    assert "gpt2" in (lean.supports(gpt2) or "")
    gelu = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, hidden_act="gelu", **(TINY | {"vocab_size": 64})))
    assert "gelu" in (lean.supports(gelu) or "")
    with pytest.raises(ValueError, match="gelu"):
        lean.LeanForward(gelu)
    assert lean.supports(AutoModelForCausalLM.from_pretrained(tiny_qwen2)) is None


@pytest.fixture(scope="module")
def sliding_qwen2(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    torch.manual_seed(0)
    window = dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **window, **TINY)
    return save_model(Qwen2ForCausalLM(config), tmp_path_factory.mktemp("sliding-qwen2"), smol_dir)


def test_engine_keeps_transformers_forward_where_lean_cannot(sliding_qwen2: Path) -> None:
    with pytest.raises(ValueError, match="sliding"):
        engine(sliding_qwen2, "lean")
    e = engine(sliding_qwen2, "auto")
    assert e.lean is None
    out = e.step(StepInput(seqs=[SeqInput("s", [5, 6, 7], 0, [0])]))
    assert len(out.tokens) == 1
    with pytest.raises(ValueError, match="model_impl"):
        engine(sliding_qwen2, "fast")
