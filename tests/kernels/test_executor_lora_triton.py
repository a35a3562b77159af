"""The executor's LoRA hooks on their CUDA path (the Triton BGMV kernel, interpreter mode on CPU)
give the same greedy tokens as their torch path, three adapters and the base model in each step."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor_svc.engine import Engine, EngineConfig
from executor_svc.lora import LoraConfig
from executor_svc.plan import LoraRef, SeqInput, StepInput
from executor_svc.sampler import Sampling
from pagedserve.lora import read as read_adapter
from tests.lora_support import make_adapter


def engine_greedy(engine: Engine, prompts: list[list[int]], refs: list[LoraRef | None], steps: int) -> list[list[int]]:
    """Drive an executor's engine as a scheduler would (one prefill chunk, then decodes), every
    sequence with its adapter in the same steps; greedy tokens per sequence."""
    bs, top = engine.geometry.block_size, engine.pool.device.num_blocks
    tables = []
    for p in prompts:
        n = -(-(len(p) + steps) // bs)
        tables.append(list(range(top - n, top)))
        top -= n
    outs: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        seqs = [
            SeqInput(
                str(i),
                list(p) if step == 0 else outs[i][-1:],
                0 if step == 0 else len(p) + step - 1,
                tables[i],
                Sampling(temperature=0.0),
                num_generated=step,
                lora=ref,
            )
            for i, (p, ref) in enumerate(zip(prompts, refs))
        ]
        for rid, t in engine.step(StepInput(step_id=step, seqs=seqs)).tokens:
            outs[int(rid)].append(t)
    return outs


def lora_ref(name: str, path: Path) -> LoraRef:
    adapter = read_adapter(name, str(path), 64)
    return LoraRef(adapter.digest, adapter.path, name)


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
