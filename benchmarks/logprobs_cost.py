"""What logprobs cost: tokens/s of greedy requests with ``logprobs=5`` against plain greedy.

One real deployment (Redis + scheduler + executor, over gRPC; the one the structured arm uses too, see
``benchmarks.bench``), one batch of identical-shape
greedy requests sent at once, plain and with logprobs in ``rounds`` rounds, in ABBA order
(plain first in even rounds, last in odd ones) so that load drifting over the run hits
both alike; each round's ratio is logprobs tokens/s over plain tokens/s, and the reported
ratio is their median. The logprobs
requests pay a log_softmax and a top-k over the vocabulary per token on the executor,
and the entries' way through Redis, the events and the frontend.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from benchmarks.stack import Stack
from benchmarks.workload import Vocab
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass(slots=True)
class LogprobsConfig:
    requests: int = 32  # sent at once: a decode batch of 32
    prompt_len: int = 32
    output_len: int = 12
    rounds: int = 2
    top: int = 5  # alternatives per token


@dataclass(slots=True)
class LogprobsResult:
    plain_tokens_per_s: list[float] = field(default_factory=list)  # per round
    logprobs_tokens_per_s: list[float] = field(default_factory=list)
    ratio: float | None = None  # median over rounds of logprobs / plain
    config: dict[str, int] = field(default_factory=dict)


def _requests(cfg: LogprobsConfig, vocab: Vocab, top: int | None) -> list[pb.GenerateRequest]:
    rng = random.Random(0)
    return [
        pb.GenerateRequest(
            prompt_token_ids=[rng.randrange(vocab.low, vocab.size) for _ in range(cfg.prompt_len)],
            sampling=pb.SamplingParams(max_tokens=cfg.output_len, temperature=0.0, ignore_eos=True, logprobs=top),
        )
        for _ in range(cfg.requests)
    ]


async def _tokens_per_s(address: str, reqs: list[pb.GenerateRequest]) -> float:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def one(r: pb.GenerateRequest) -> int:
            return sum([len(x.token_ids) async for x in stub.Generate(r, timeout=600)])

        t = time.perf_counter()
        n = sum(await asyncio.gather(*(one(r) for r in reqs)))
        return n / (time.perf_counter() - t)


def run(model_dir: Path, deployment: Stack, cfg: LogprobsConfig) -> LogprobsResult:
    """On a live deployment whose ``--max-num-seqs`` admits ``cfg.requests`` at once."""
    vocab = Vocab.from_model_dir(model_dir)
    plain, with_lp = _requests(cfg, vocab, None), _requests(cfg, vocab, cfg.top)
    out = LogprobsResult(
        config={
            "requests": cfg.requests,
            "prompt_len": cfg.prompt_len,
            "output_len": cfg.output_len,
            "rounds": cfg.rounds,
            "top": cfg.top,
        }
    )
    address = deployment.address
    asyncio.run(_tokens_per_s(address, plain[:2]))  # warm-up: first forwards pay one-off costs
    for r in range(cfg.rounds):
        if r % 2 == 0:
            out.plain_tokens_per_s.append(asyncio.run(_tokens_per_s(address, plain)))
        out.logprobs_tokens_per_s.append(asyncio.run(_tokens_per_s(address, with_lp)))
        if r % 2 == 1:
            out.plain_tokens_per_s.append(asyncio.run(_tokens_per_s(address, plain)))
    ratios = [lp / p for p, lp in zip(out.plain_tokens_per_s, out.logprobs_tokens_per_s) if p > 0]
    out.ratio = round(statistics.median(ratios), 3) if ratios else None
    return out
