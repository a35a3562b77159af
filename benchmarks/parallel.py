"""The parallel-sampling arm: one request with ``n`` = 8 against eight requests of their own.

One deployment (the logprobs and structured arms' own, whose KV holds the
eight independent requests whole), two rounds on it, one after the other: a request with a
512-token prompt asking for 8 seeded completions (``sampling.n``), then the
same prompt as 8 requests of their own with seeds seed + i (what completion i
samples with) and a distinct ``cache_salt`` each, so that nothing is shared
between them (the prefix cache is on: without salts the later ones would find
the earlier ones' blocks). Both rounds generate 8 x ``output_len`` tokens.

``n8_block_ratio``: device KV blocks held at the peak of the n round over the
peak of the independent round, from the scheduler's step log (blocks held by
requests; cached blocks nobody holds are free). With a prompt of P tokens the
group holds about P/16 shared blocks plus 8 x (output/16 + 1), against
8 x (P + output)/16.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from benchmarks.arm_pagedserve import read_steps
from benchmarks.stack import Stack
from benchmarks.workload import Vocab
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    n: int = 8
    prompt_len: int = 512
    output_len: int = 32
    seed: int = 0


@dataclass(slots=True)
class ParallelResult:
    config: ParallelConfig
    peak_blocks: dict[str, int] = field(default_factory=dict)  # "n" and "independent"
    output_tokens_per_s: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def ratio(self) -> float | None:
        n, ind = self.peak_blocks.get("n"), self.peak_blocks.get("independent")
        return n / ind if n is not None and ind else None

    def as_dict(self) -> dict[str, object]:
        c = self.config
        return {
            "n": c.n,
            "prompt_len": c.prompt_len,
            "output_len": c.output_len,
            "peak_blocks": self.peak_blocks,
            "output_tokens_per_s": self.output_tokens_per_s,
            "tokens": self.tokens,
            "n8_block_ratio": self.ratio(),
        }


def _sampling(cfg: ParallelConfig, seed: int, n: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=cfg.output_len, temperature=1.0, seed=seed, ignore_eos=True, n=n)


async def _tokens(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> int:
    return sum([len(m.token_ids) async for m in stub.Generate(req, timeout=600)])


async def _rounds(address: str, prompt: list[int], cfg: ParallelConfig) -> dict[str, tuple[float, float, int]]:
    """(start wall time, duration, tokens) of each round, after a warm-up."""
    out: dict[str, tuple[float, float, int]] = {}
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.GenerationStub(ch)
        await _tokens(stub, pb.GenerateRequest(prompt_token_ids=prompt[:8], sampling=_sampling(cfg, 1, 1)))
        rounds = {
            "n": [pb.GenerateRequest(prompt_token_ids=prompt, sampling=_sampling(cfg, cfg.seed, cfg.n))],
            "independent": [
                pb.GenerateRequest(
                    prompt_token_ids=prompt, sampling=_sampling(cfg, cfg.seed + i, 1), cache_salt=f"independent-{i}"
                )
                for i in range(cfg.n)
            ],
        }
        for name, reqs in rounds.items():
            await asyncio.sleep(0.5)  # the previous round's last commit lands in the step log before this one
            wall, t0 = time.time(), time.perf_counter()
            got = await asyncio.gather(*(_tokens(stub, r) for r in reqs))
            out[name] = (wall, time.perf_counter() - t0, sum(got))
    return out


def run(model_dir: Path, deployment: Stack, cfg: ParallelConfig) -> ParallelResult:
    """On a live deployment with a step log whose pool holds the ``n`` independent requests whole."""
    out = ParallelResult(cfg)
    step_log = deployment.config.step_log
    if step_log is None:
        raise ValueError("the parallel arm reads the scheduler's step log: its deployment needs one")
    vocab = Vocab.from_model_dir(model_dir)
    prompt = [int(t) for t in np.random.default_rng(cfg.seed).integers(vocab.low, vocab.size, cfg.prompt_len)]
    rounds = asyncio.run(_rounds(deployment.address, prompt, cfg))
    steps = read_steps(step_log, 0)
    block = deployment.config.block_size
    for name, (wall, duration, tokens) in rounds.items():
        held = [s["allocated_slots"] // block for s in steps if wall <= s["t"] <= wall + duration + 0.5]
        out.peak_blocks[name] = int(max(held, default=0))
        out.output_tokens_per_s[name] = tokens / duration if duration > 0 else 0.0
        out.tokens[name] = tokens
        if tokens != cfg.n * cfg.output_len:
            out.errors.append(f"parallel {name}: {tokens} tokens, expected {cfg.n * cfg.output_len}")
    return out
