"""KV usage spread across real executors under a uniform load.

Redis, ``executors`` real executor_svc processes with the same KV budget
(registered in one namespace, as ``pagedserve.dev.launch.Cluster`` starts them,
but in parallel: ``benchmarks.stack``) and one scheduler. After one warm-up request per executor, a
uniform workload (prompt and output lengths drawn relative to the budget, all
requests at once, ``ignore_eos``) fills both pools while a sampler reads the
namespace's ``usage`` hash (each loop publishes its pool's free blocks per
tier) and the shared queue's length every ``sample_s``. Per sample, the spread
is the largest minus the smallest device-used fraction across executors. The
headline mean and max are over the middle 80% of the run (of the time some
pool holds blocks), which still holds part of the fill-up and of the drain;
``loaded_*`` are over the samples in which requests wait in the queue, where
both pools are under the same full load.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import redis.asyncio as aioredis

from benchmarks.arm_pagedserve import drive, request_pb
from benchmarks.stack import Stack, StackConfig, start
from benchmarks.workload import Vocab, WorkloadSpec, make_workload
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

NAMESPACE = "kvspread"


@dataclass(slots=True)
class SpreadConfig:
    kv_budget_tokens: int = 1024  # per executor
    num_requests: int = 48
    executors: int = 2
    sample_s: float = 0.05  # the tiny test model's run lasts ~0.1 s: its test samples every 2 ms
    seed: int = 0

    def spec(self) -> WorkloadSpec:
        """Prompts of 1/64-1/32 of the budget and outputs of 1/32-1/16 (16-32 and 32-64 tokens at 1024):
        a pool holds a dozen or more at once, so one request moves its used fraction by a few percent."""
        b = self.kv_budget_tokens
        return WorkloadSpec(
            "uniform",
            self.num_requests,
            1.0,
            (max(2, b // 64), max(3, b // 32)),
            (max(2, b // 32), max(3, b // 16)),
            b,
            None,
            self.seed,
        )


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    used: dict[str, float]  # executor -> device-used fraction
    queued: int  # requests waiting in the shared queue


@dataclass(slots=True)
class SpreadResult:
    mean: float | None
    max: float | None
    executors: int
    samples: int  # in the middle of the run
    mean_used: float | None  # mean device-used fraction over executors and those samples
    loaded_mean: float | None  # the same spread while requests wait in the queue (both pools under full load)
    loaded_max: float | None
    duration_s: float
    failures: int
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # executor -> (t, used fraction)

    def as_dict(self) -> dict[str, object]:
        return {
            "mean": self.mean,
            "max": self.max,
            "executors": self.executors,
            "samples": self.samples,
            "mean_used": self.mean_used,
            "loaded_mean": self.loaded_mean,
            "loaded_max": self.loaded_max,
            "duration_s": self.duration_s,
            "failures": self.failures,
        }


def used_fractions(usage: dict[str, str]) -> dict[str, float]:
    """Device-used fraction per executor from the ``usage`` hash (JSON with ``blocks``/``free`` per tier)."""
    out = {}
    for eid, raw in usage.items():
        u = json.loads(raw)
        total = u["blocks"][0]
        out[eid] = 1 - u["free"][0] / total if total else 0.0
    return out


async def _sample(url: str, keys: Keys, every: float, stop: asyncio.Event, samples: list[Sample]) -> None:
    client = aioredis.from_url(url, decode_responses=True)
    try:
        while not stop.is_set():
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(keys.usage)
            pipe.zcard(keys.queue)
            usage, queued = await pipe.execute()
            samples.append(Sample(time.time(), used_fractions(usage), int(queued)))
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass
    finally:
        await client.aclose()


async def _all_led(url: str, keys: Keys, executors: int, timeout: float = 60) -> None:
    """Wait until every executor's loop has published its pool (so the burst spreads from the start)."""
    client = aioredis.from_url(url, decode_responses=True)
    try:
        deadline = time.monotonic() + timeout
        while await client.hlen(keys.usage) < executors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {executors} executors led after {timeout:.0f} s")
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()


async def _warm_up(address: str, executors: int, vocab: Vocab) -> None:
    """One short request per executor at once (placement puts them on different pools), so that no executor's
    first forward pass, which pays one-off costs, skews the start of the run."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.GenerationStub(channel)
        reqs = [request_pb([vocab.low + i] * 8, 4, f"kv-warm-{i}") for i in range(executors)]
        await asyncio.gather(*(_drain(stub.Generate(r)) for r in reqs))


async def _drain(call) -> None:  # type: ignore[no-untyped-def]
    async for _ in call:
        pass


async def _run(dep: Stack, cfg: SpreadConfig, vocab: Vocab) -> tuple[list[Sample], int, float]:
    samples: list[Sample] = []
    keys = Keys(NAMESPACE)
    await _all_led(dep.redis.url, keys, cfg.executors)
    await _warm_up(dep.scheduler.address, cfg.executors, vocab)
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample(dep.redis.url, keys, cfg.sample_s, stop, samples))
    try:
        _, wall0, duration, failures = await drive(dep.scheduler.address, make_workload(cfg.spec(), vocab))
    finally:
        stop.set()
        await sampler
    return [s for s in samples if s.t >= wall0], len(failures), duration  # after drive's own warm-up request


def _spread(samples: list[Sample]) -> list[float]:
    return [max(s.used.values()) - min(s.used.values()) for s in samples]


def _middle(samples: list[Sample]) -> list[Sample]:
    """The middle 80% of the time some pool holds blocks."""
    busy = [s.t for s in samples if max(s.used.values()) > 0]
    if not busy:
        return []
    lo, hi = busy[0] + 0.1 * (busy[-1] - busy[0]), busy[0] + 0.9 * (busy[-1] - busy[0])
    return [s for s in samples if lo <= s.t <= hi] or [s for s in samples if busy[0] <= s.t <= busy[-1]]


def summarize(samples: list[Sample], executors: int, duration: float, failures: int) -> SpreadResult:
    full = [s for s in samples if len(s.used) == executors]
    series: dict[str, list[tuple[float, float]]] = {}
    for s in full:
        for eid, f in s.used.items():
            series.setdefault(eid, []).append((s.t, f))
    mid = _middle(full)
    loaded = _spread([s for s in full if s.queued > 0])
    if not mid:
        return SpreadResult(None, None, executors, 0, None, None, None, duration, failures, series)
    spread = _spread(mid)
    return SpreadResult(
        float(np.mean(spread)),
        float(np.max(spread)),
        executors,
        len(mid),
        float(np.mean([f for s in mid for f in s.used.values()])),
        float(np.mean(loaded)) if loaded else None,
        max(loaded, default=None),
        duration,
        failures,
        series,
    )


def stack_config(cfg: SpreadConfig, per_token_bytes: int) -> StackConfig:
    """``cfg.executors`` executors of one budget, registered in one namespace, and one scheduler."""
    budget = cfg.kv_budget_tokens
    return StackConfig(
        budget * per_token_bytes,
        16,
        ("--max-model-len", str(budget), "--swap-space", "0.05", "--drain-timeout", "5"),
        executors=cfg.executors,
        namespace=NAMESPACE,
    )


def run(model_dir: Path, cfg: SpreadConfig, per_token_bytes: int, log_dir: Path) -> SpreadResult:
    with start(model_dir, stack_config(cfg, per_token_bytes), log_dir) as dep:
        samples, failures, duration = asyncio.run(_run(dep, cfg, Vocab.from_model_dir(model_dir)))
    return summarize(samples, cfg.executors, duration, failures)
