"""The executor's LoRA hooks on their CUDA path (the Triton BGMV kernel, interpreter mode on CPU)
give the same greedy tokens as their torch path, three adapters and the base model in each step."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_svc.engine import Engine, EngineConfig
from executor_svc.lora import LoraConfig
from tests.test_lora import engine_greedy, lora_ref, make_adapter


def test_triton_lora_path_matches_torch_path(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("adapters")
    refs = [lora_ref(str(i), make_adapter(tiny_llama, root / str(i), 20 + i, r=4 + 4 * i)) for i in range(3)]
    prompts = [[5 + i for i in range(n)] for n in (7, 16, 5, 9)]
    results = {}
    for path in ("torch", "triton"):
        engine = Engine(EngineConfig(model=tiny_llama, kv_cache_memory=1 << 20, lora=LoraConfig(max_loras=3)))
        assert engine.adapters is not None
        engine.adapters.triton = path == "triton"  # the kernel runs on CPU tensors under TRITON_INTERPRET=1
        results[path] = engine_greedy(engine, prompts, [*refs, None], 4)
    assert results["triton"] == results["torch"]
