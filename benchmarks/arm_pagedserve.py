"""Arm 1: pagedserve deployed for real (Redis + scheduler_svc + executor_svc) and driven over gRPC."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks import stack
from benchmarks.metrics import RequestRecord
from benchmarks.workload import Request, Workload
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass(slots=True)
class ServeConfig:
    kv_budget_bytes: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "auto"
    swap_space_gib: float = 0.25
    max_model_len: int = 2048
    prefix_caching: bool = True  # the scheduler's --enable-prefix-caching


@dataclass(slots=True)
class ServeResult:
    records: list[RequestRecord]
    duration: float
    steps: list[dict[str, float]]  # step-log lines written during the timed run
    log_dir: Path
    failures: list[str]


def request_pb(prompt_ids: list[int], max_tokens: int, rid: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt_ids,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _one(stub: pb_grpc.GenerationStub, req: Request, t0: float, failures: list[str]) -> RequestRecord | None:
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    arrival = time.perf_counter() - t0
    times: list[float] = []
    received = 0
    try:
        async for resp in stub.Generate(request_pb(req.prompt_ids, req.output_len, f"bench-{req.index}")):
            if resp.token_ids:
                times.append(time.perf_counter() - t0)
                received += len(resp.token_ids)
    except grpc.aio.AioRpcError as exc:
        failures.append(f"request {req.index}: {exc.code().name}: {exc.details()}")
        return None
    if not times:
        failures.append(f"request {req.index}: no tokens")
        return None
    return RequestRecord(req.index, len(req.prompt_ids), received, arrival, times[0], times[-1], times)


async def drive(address: str, workload: Workload) -> tuple[list[RequestRecord], float, float, list[str]]:
    """One task per request on a shared channel; returns records, wall-clock start, duration and failures."""
    failures: list[str] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.GenerationStub(channel)
        warm = Request(-1, workload.requests[0].prompt_ids[:8], 4, 0.0)
        await _one(stub, warm, time.perf_counter(), failures)  # first forward pays one-off costs
        wall0, t0 = time.time(), time.perf_counter()
        done = await asyncio.gather(*(_one(stub, r, t0, failures) for r in workload.requests))
        duration = time.perf_counter() - t0
    return [r for r in done if r is not None], wall0, duration, failures


def executor_args(cfg: ServeConfig) -> list[str]:
    """The executor's flags in this arm (the stack adds model, block size and budget itself)."""
    return ["--swap-space", str(cfg.swap_space_gib), "--max-model-len", str(cfg.max_model_len)]


def standalone_executor_args(model_dir: Path, cfg: ServeConfig) -> list[str]:
    """The same executor as this arm's, flags in full: for probes that need one of their own."""
    return [
        "--model",
        str(model_dir),
        "--block-size",
        str(cfg.block_size),
        "--kv-cache-memory",
        str(cfg.kv_budget_bytes),
        *executor_args(cfg),
    ]


def stack_config(cfg: ServeConfig, step_log: Path) -> stack.StackConfig:
    """This arm's deployment; an arm with an equal ``ServeConfig`` (step log aside) shares it."""
    sched = (
        "--max-num-seqs",
        str(cfg.max_num_seqs),
        "--max-num-batched-tokens",
        str(cfg.max_num_batched_tokens),
        "--preemption-mode",
        cfg.preemption_mode,
        "--enable-prefix-caching" if cfg.prefix_caching else "--no-enable-prefix-caching",
    )
    return stack.StackConfig(cfg.kv_budget_bytes, cfg.block_size, tuple(executor_args(cfg)), sched, step_log=step_log)


def read_steps(path: Path | None, since: float) -> list[dict[str, float]]:
    rows = [] if path is None else stack.read_log(path)
    return [r for r in rows if r["t"] >= since]


def serve(deployment: stack.Stack, workload: Workload) -> ServeResult:
    """Serve ``workload`` on a live deployment; its step-log lines from the timed run on (read at once, so a
    deployment that serves another arm next adds none)."""
    records, wall0, duration, failures = asyncio.run(drive(deployment.address, workload))
    steps = read_steps(deployment.config.step_log, wall0)
    return ServeResult(records, duration, steps, deployment.log_dir, failures)


def run(model_dir: Path, workload: Workload, cfg: ServeConfig, log_dir: Path) -> ServeResult:
    """Serve ``workload`` on a deployment of its own, torn down after."""
    with stack.start(model_dir, stack_config(cfg, log_dir / "steps.jsonl"), log_dir) as deployment:
        return serve(deployment, workload)
