"""The executor forced onto the Triton path (interpreter mode, CPU) produces the
same greedy tokens as the torch path, through prefill chunks and decodes."""

from __future__ import annotations

from pathlib import Path

from executor_svc.engine import Engine, EngineConfig
from executor_svc.plan import SeqInput, StepInput
from executor_svc.sampler import Sampling


def run(engine: Engine, prompts: list[list[int]], steps: int, chunk: int) -> list[list[int]]:
    """Drive the engine like the scheduler would: chunked prefill, then decode."""
    bs = engine.geometry.block_size
    tables, next_block = [], engine.pool.device.num_blocks - 1
    for p in prompts:  # blocks handed out from the top of the pool, scattered across sequences
        n = -(-(len(p) + steps) // bs)
        tables.append(list(range(next_block, next_block - n, -1)))
        next_block -= n
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    for step in range(200):
        seqs = []
        for i, toks in enumerate(tokens):
            if len(outs[i]) >= steps:
                continue
            n = min(chunk, len(toks) - done[i])
            seqs.append(
                SeqInput(
                    str(i),
                    toks[done[i] : done[i] + n],
                    done[i],
                    tables[i],
                    Sampling(temperature=0.0),
                    done[i] + n == len(toks),
                    len(outs[i]),
                )
            )
        if not seqs:
            break
        out = engine.step(StepInput(step_id=step, seqs=seqs))
        for s in seqs:
            done[int(s.request_id)] += len(s.token_ids)
        for rid, t in out.tokens:
            outs[int(rid)].append(t)
            tokens[int(rid)].append(t)
    return outs


def test_triton_path_matches_torch_path(tiny_llama: Path) -> None:
    prompts = [[5 + i for i in range(n)] for n in (7, 16, 23)]
    results = {}
    for backend in ("torch", "triton"):
        engine = Engine(
            EngineConfig(model=tiny_llama, kv_cache_memory=1 << 20, attention_backend=backend, swap_space=0)
        )
        assert engine.backend.name == backend
        results[backend] = run(engine, prompts, steps=6, chunk=10)
    assert results["triton"] == results["torch"]
    assert all(len(o) == 6 for o in results["torch"])
