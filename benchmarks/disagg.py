"""Prefill and decode executors against mixed ones (issue 26): decode ITL, throughput and TTFT.

Two executors either way: 1 ``--role prefill`` + 1 ``--role decode`` (**disaggregated**) against 2 ``mixed``,
behind one real ``scheduler_svc`` with the same flags in both runs (``--disagg-min-prompt-tokens``, which does
nothing without a prefill executor, and ``--max-num-batched-tokens``, the prefill chunk: both a quarter of the
long prompt). The workload, the same in both runs (seeded): a **stream of decodes** (``decode_streams``
clients, each sending one short-prompt request after another, ``ignore_eos``, output lengths drawn around
``decode_output_len``) and **long-prompt arrivals** (a ``long_prompt_len``-token prompt, ``long_output_len``
tokens, every T s, T = the prompt's prefill alone by the fitted step model / ``prefill_load``: the long prompts
keep one executor's prefill that busy whatever this machine's speed). Prompts are fresh random token ids: no
prefix is cached anywhere. Measured by the client over a window after a warm-up:

- **ITL**: the gaps between consecutive streamed messages of every request (all decode gaps: a disaggregated
  request's first gap includes its handoff's short stop); ``pd_itl_p99_ratio`` is its p99 disaggregated /
  mixed;
- **throughput**: output tokens received in the window / the window (``pd_throughput_ratio``);
- **TTFT** of the long prompts that arrived in the window (``pd_ttft_p50_ratio``, p50); the decode streams'
  TTFT is reported beside it.

First the **fit** (``calibrate``): two real ``executor_svc`` processes of the model, on their own (not
registered, no scheduler), get hand-made plans over ``Step``: each point of a grid of (prefill tokens, decode
sequences) is one prefill chunk at ``chunk_start`` beside that many one-token decode rows at ``context``
tokens of context, timed by the executor's own report (``StepResult.step_ms``, median of ``reps``); least
squares give ``step_ms = a + b x prefill tokens + c x decode sequences`` (and R^2). Then the first executor
lends blocks (a plan's ``lends``) and the second pulls them (a plan's ``pulls``, over the real ``ReadBlocks``):
``PullResult.ms`` per size gives ``pull_ms = d + e x blocks``. Then the scales (``scales``):

1. **Modelled** (the figures the target reads; ``pd_*_ratio``): ``benchmarks.stub_executor`` with
   ``--step-model a,b,c --pull-model d,e`` (no KV moves: a stub's pull checks the lend at the source over
   ``ReadBlocks`` and sleeps the modelled time beside its step). The stubs sleep (``asyncio.sleep``), so two of
   them on this machine behave as two machines would: where disaggregation is meant to run. The long prompts
   keep a prefill executor 80% busy.
2. **Light** (``_light``): the same with long prompts keeping it 25% busy.
3. **Real** (``_real``): the same arm, smaller, on real executors of the model. Both executors and everything
   else share this machine's cores, so a prefill on the prefill executor still slows the decode executor
   down: reported beside the modelled figures, with that caveat; no target reads them.

The disaggregated runs must really disaggregate: the prefill executor's ``migrations_disagg`` counter (requests
it handed over) is reported, with the decode executor's ``handoff_blocks`` and the failed pulls; a run that
handed nothing over is an error.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
import redis.asyncio as aioredis

from benchmarks.config import kv_bytes_per_token
from benchmarks.metrics import percentiles
from benchmarks.stack import StackConfig, read_log
from benchmarks.stack import start as start_stack
from benchmarks.workload import Vocab
from pagedserve.dev.procs import RedisServer, Service, free_port, start_all, stop_all
from pagedserve.executor.v1 import executor_pb2 as xpb
from pagedserve.executor.v1 import executor_pb2_grpc as xpb_grpc
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

MODES = ("mixed", "disagg")
ROLES = {"mixed": ("mixed", "mixed"), "disagg": ("prefill", "decode")}
NAMESPACE = "pd"
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class PdWorkload:
    """One scale of the arm: the workload and the flags both of its runs share."""

    decode_streams: int = 32
    decode_prompt_len: int = 32
    decode_output_len: int = 256  # each request draws its output length from [0.5, 1.5] x this
    long_prompt_len: int = 2048
    long_output_len: int = 32
    # How often a long prompt arrives: every (its prefill alone, by the fitted step model) / prefill_load seconds,
    # so that the long prompts keep one executor's prefill that busy whatever this machine's speed.
    prefill_load: float = 0.8
    chunk_tokens: int = 512  # --max-num-batched-tokens: a prefill chunk
    min_prompt_tokens: int = 512  # --disagg-min-prompt-tokens
    warmup_s: float = 4.0
    window_s: float = 40.0
    kv_cache_tokens: int = 65536  # per executor: the stubs' --num-gpu-blocks x 16, the real --kv-cache-memory
    first_token_grace_s: float = 60.0  # after the window: how long the window's long prompts may take to start
    min_every_s: float = 0.25  # long prompts never come more often (a tiny model's prefill is almost free)

    @classmethod
    def sized(cls, long_prompt_len: int, **kw: object) -> PdWorkload:
        """A scale whose chunk and threshold follow its long prompt: chunks of a quarter of it (512 for 2,048
        tokens), disaggregated above one chunk; the decode streams' prompts stay under half of that."""
        chunk = max(16, long_prompt_len // 4)
        decode_prompt = min(32, chunk // 2)
        window = float(kw.get("window_s", 40.0))  # type: ignore[arg-type]
        return cls(  # type: ignore[arg-type]
            long_prompt_len=long_prompt_len,
            chunk_tokens=chunk,
            min_prompt_tokens=chunk,
            decode_prompt_len=decode_prompt,
            warmup_s=min(4.0, window / 4),
            **kw,
        )

    def every_s(self, fit: StepFit) -> float:
        """Seconds between long-prompt arrivals."""
        chunks = -(-self.long_prompt_len // self.chunk_tokens)
        prefill_ms = chunks * fit.a_ms + self.long_prompt_len * fit.b_ms_per_prefill_token
        return max(self.min_every_s, prefill_ms / 1e3 / self.prefill_load)

    def long_arrivals(self, every: float) -> list[float]:
        """Arrival times (s from the start) of the long prompts: the window's, plus one before it."""
        first = max(0.0, self.warmup_s - every / 2)
        n = int((self.warmup_s + self.window_s - first) // every) + 1
        return [first + k * every for k in range(n)]


@dataclass(frozen=True, slots=True)
class FitConfig:
    prefill_tokens: tuple[int, ...] = (0, 64, 256, 512)
    decode_seqs: tuple[int, ...] = (0, 1, 8, 32)
    context: int = 256  # each decode row's context
    chunk_start: int = 512  # where the timed prefill chunk starts (a long prompt's chunks sit past its start)
    reps: int = 3
    pull_blocks: tuple[int, ...] = (8, 32, 128)

    @classmethod
    def sized(cls, chunk: int, reps: int = 3) -> FitConfig:
        """Prefill chunks up to ``chunk`` tokens (0, an eighth, a half, whole), timed one chunk into a prompt."""
        return cls(prefill_tokens=(0, max(1, chunk // 8), max(2, chunk // 2), chunk), chunk_start=chunk, reps=reps)


@dataclass(frozen=True, slots=True)
class Scale:
    """One scale of the arm: stub executors on the fitted model (``stub``) or real ones."""

    name: str  # summary keys: pd_..._ratio plus _light / _real for the other scales
    workload: PdWorkload
    stub: bool = True


def scales(
    window_s: float = 40.0,
    light_window_s: float = 30.0,
    real_window_s: float = 30.0,
    decode_streams: int = 32,
    long_prompt_len: int = 2048,
    real_long_prompt_len: int = 1024,
) -> list[Scale]:
    """The arm's scales (a window of 0 leaves one out): the modelled one the target reads (the long prompts keep
    a prefill executor 80% busy), the same with light long-prompt traffic (25%), and the real model, smaller."""
    out = [Scale("", PdWorkload.sized(long_prompt_len, decode_streams=decode_streams, window_s=window_s))]
    if light_window_s > 0:
        light = PdWorkload.sized(
            long_prompt_len, decode_streams=decode_streams, window_s=light_window_s, prefill_load=0.25
        )
        out.append(Scale("_light", light))
    if real_window_s > 0:
        real = PdWorkload.sized(
            real_long_prompt_len,
            decode_streams=max(1, decode_streams // 8),
            decode_output_len=64,
            long_output_len=16,
            prefill_load=0.3,
            window_s=real_window_s,
            kv_cache_tokens=8192,
        )
        out.append(Scale("_real", real, stub=False))
    return out


@dataclass(frozen=True, slots=True)
class PdConfig:
    scales: tuple[Scale, ...] = field(default_factory=lambda: tuple(scales()))
    fit: FitConfig = field(default_factory=FitConfig)
    seed: int = 0


# ---------------------------------------------------------------------------------------------- the fit
@dataclass(slots=True)
class StepFit:
    """``step_ms = a + b x prefill_tokens + c x decode_seqs``; ``pull_ms = d + e x blocks`` (this machine)."""

    a_ms: float
    b_ms_per_prefill_token: float
    c_ms_per_decode_seq: float
    r2: float
    max_rel_error: float  # the largest |measured - model| / measured over the grid
    points: list[dict[str, float]]  # per grid point: prefill, decode, measured step_ms (median), predicted
    pull_fixed_ms: float
    pull_ms_per_block: float
    pull_points: list[dict[str, float]]
    context: int
    chunk_start: int
    threads: str | None = None  # the executors' OMP_NUM_THREADS

    def step_model(self) -> str:
        """The stubs' ``--step-model`` (coefficients clamped at 0: a stub sleeps no negative time)."""
        return ",".join(
            f"{max(0.0, v):.6g}" for v in (self.a_ms, self.b_ms_per_prefill_token, self.c_ms_per_decode_seq)
        )

    def pull_model(self) -> str:
        return ",".join(f"{max(0.0, v):.6g}" for v in (self.pull_fixed_ms, self.pull_ms_per_block))


def fit_linear(rows: list[tuple[float, ...]], ys: list[float]) -> tuple[list[float], float, float]:
    """``ys`` ~ ``[1, *row] . coef``, least squares of the **relative** residuals (each point weighted by
    1 / y: a 30 ms decode step counts as much as a 1 s prefill, and the decode steps are what ITL is made of);
    the coefficients, R^2 and the largest relative error over the points."""
    x = np.array([[1.0, *r] for r in rows])
    y = np.array(ys)
    w = 1.0 / np.maximum(np.abs(y), 1e-9)
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    resid = y - x @ coef
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else 1.0
    return [float(c) for c in coef], r2, float(np.max(np.abs(resid) * w))


def _ids(rng: random.Random, vocab: Vocab, n: int) -> list[int]:
    return [rng.randrange(vocab.low, vocab.size) for _ in range(n)]


def _greedy() -> xpb.Sampling:
    return xpb.Sampling(temperature=0.0)


def calibrate(model_dir: Path, cfg: FitConfig, log_dir: Path, seed: int = 0) -> StepFit:
    """The step-time and pull-time models, from two real executors' own reports of hand-made plans."""
    bs = BLOCK_SIZE
    rows, per_row = max(cfg.decode_seqs), -(-(cfg.context + 1) // bs)
    chunk_blocks = -(-(cfg.chunk_start + max(cfg.prefill_tokens)) // bs)
    pull = max(cfg.pull_blocks, default=0)
    blocks = rows * per_row + chunk_blocks + 2 * pull + 1
    budget = blocks * bs * kv_bytes_per_token(model_dir)
    max_len = max(cfg.chunk_start + max(cfg.prefill_tokens), cfg.context + 1) + bs
    log_dir.mkdir(parents=True, exist_ok=True)

    def executor(i: int) -> Service:
        args = ["--model", str(model_dir), "--block-size", str(bs), "--kv-cache-memory", str(budget)]
        args += ["--max-model-len", str(max_len), "--swap-space", "0", "--host", "127.0.0.1"]
        args += ["--redis-url", "", "--drain-timeout", "0"]
        return Service("executor_svc", args, free_port(), log_dir / f"executor-{i}.log")

    services = start_all([lambda: executor(0), lambda: executor(1)])
    try:
        return _calibrate(services[0].address, services[1].address, cfg, rows, per_row, seed, model_dir)
    finally:
        stop_all(services)


def _calibrate(first: str, second: str, cfg: FitConfig, rows: int, per_row: int, seed: int, model_dir: Path) -> StepFit:
    bs = BLOCK_SIZE
    vocab = Vocab.from_model_dir(model_dir)
    rng = random.Random(seed)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
    base = rows * per_row
    chunk_table = list(range(base, base + -(-(cfg.chunk_start + max(cfg.prefill_tokens)) // bs)))
    prompts = [_ids(rng, vocab, cfg.context + 1) for _ in range(rows)]
    chunk = _ids(rng, vocab, max(cfg.prefill_tokens))
    with (
        grpc.insecure_channel(first, options=CHANNEL_OPTIONS) as ch1,
        grpc.insecure_channel(second, options=CHANNEL_OPTIONS) as ch2,
    ):
        a, b = xpb_grpc.ExecutorStub(ch1), xpb_grpc.ExecutorStub(ch2)
        step_id = 0

        def step(stub: xpb_grpc.ExecutorStub, **kw: object) -> xpb.StepResult:
            nonlocal step_id
            step_id += 1
            return stub.Step(xpb.StepPlan(step_id=step_id, **kw), timeout=600)  # type: ignore[arg-type]

        # The decode rows' context, a few rows a plan (one plan of every row at once would be a long prefill).
        for i in range(0, rows, 4):
            seqs = [
                xpb.SeqPlan(
                    request_id=f"row-{j}",
                    token_ids=prompts[j][:-1],
                    start_pos=0,
                    block_table=tables[j],
                    full_table=True,
                    sample=False,
                    sampling=_greedy(),
                )
                for j in range(i, min(rows, i + 4))
            ]
            step(a, seqs=seqs)
        grid = [(p, d) for p in cfg.prefill_tokens for d in cfg.decode_seqs if p or d]
        samples: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
        step(a, seqs=_plan_seqs(64, 1, prompts, tables, chunk, chunk_table, cfg))  # warm-up
        for _ in range(cfg.reps):  # rep-major: load that drifts hits every point alike
            for p, d in grid:
                samples[(p, d)].append(step(a, seqs=_plan_seqs(p, d, prompts, tables, chunk, chunk_table, cfg)).step_ms)
        med = {g: statistics.median(v) for g, v in samples.items()}
        (ca, cb, cc), r2, worst = fit_linear([(float(p), float(d)) for p, d in grid], [med[g] for g in grid])
        points = [
            {"prefill_tokens": p, "decode_seqs": d, "step_ms": med[(p, d)], "model_ms": ca + cb * p + cc * d}
            for p, d in grid
        ]
        # Pulls: the first executor lends blocks, the second reads them over ReadBlocks into its own.
        info = a.Info(xpb.InfoRequest(omit_tokenizer_files=True), timeout=30)
        src0 = base + len(chunk_table)
        pulls: dict[int, list[float]] = {n: [] for n in cfg.pull_blocks}
        for rep in range(2 * cfg.reps + 1):  # pulls are cheap and noisy: twice the reps
            for n in cfg.pull_blocks:
                lend_id = f"cal-{rep}-{n}"
                src = [xpb.BlockRef(tier=xpb.TIER_DEVICE, block=src0 + k) for k in range(n)]
                step(a, lends=[xpb.Lend(lend_id=lend_id, blocks=src)])
                res = step(
                    b,
                    pulls=[
                        xpb.Pull(
                            request_id=lend_id,
                            address=first,
                            src_instance_id=info.instance_id,
                            src_epoch=0,
                            lend_id=lend_id,
                            src=src,
                            dst=[src0 + pull_room(cfg) + k for k in range(n)],
                        )
                    ],
                )
                step(a, unlends=[lend_id])
                (r,) = res.pulls
                if not r.ok:
                    raise RuntimeError(f"calibration pull of {n} blocks failed: {r.error}")
                if rep:  # the first round warms the channel up
                    pulls[n].append(r.ms)
        pmed = {n: statistics.median(v) for n, v in pulls.items() if v}
        if len(pmed) >= 2:
            (p_fixed, p_slope), _, _ = fit_linear([(float(n),) for n in pmed], list(pmed.values()))
        else:
            p_fixed, p_slope = 0.0, (next(iter(pmed.values())) / next(iter(pmed))) if pmed else 0.0
    return StepFit(
        ca,
        cb,
        cc,
        r2,
        worst,
        points,
        p_fixed,
        p_slope,
        [{"blocks": n, "ms": v, "model_ms": p_fixed + p_slope * n} for n, v in pmed.items()],
        cfg.context,
        cfg.chunk_start,
        os.environ.get("OMP_NUM_THREADS"),
    )


def pull_room(cfg: FitConfig) -> int:
    return max(cfg.pull_blocks, default=0)


def _plan_seqs(
    p: int,
    d: int,
    prompts: list[list[int]],
    tables: list[list[int]],
    chunk: list[int],
    chunk_table: list[int],
    cfg: FitConfig,
) -> list[xpb.SeqPlan]:
    """One prefill chunk of ``p`` tokens at ``cfg.chunk_start`` and ``d`` decode rows, each writing its position
    ``context`` again (every rep sees the same context)."""
    seqs = [
        xpb.SeqPlan(
            request_id=f"row-{j}",
            token_ids=[prompts[j][-1]],
            start_pos=cfg.context,
            block_table=tables[j],
            full_table=True,
            sample=True,
            sampling=_greedy(),
        )
        for j in range(d)
    ]
    if p:
        seqs.append(
            xpb.SeqPlan(
                request_id="chunk",
                token_ids=chunk[:p],
                start_pos=cfg.chunk_start,
                block_table=chunk_table,
                full_table=True,
                sample=False,
                sampling=_greedy(),
            )
        )
    return seqs


# ---------------------------------------------------------------------------------------------- a run
@dataclass(slots=True)
class Record:
    kind: str  # "decode" (a decode stream's request) or "long"
    arrival: float
    times: list[float] = field(default_factory=list)  # per streamed message with tokens
    counts: list[int] = field(default_factory=list)  # tokens in each


@dataclass(slots=True)
class RunResult:
    mode: str
    roles: tuple[str, ...]
    records: list[Record]
    window: tuple[float, float]
    counters: dict[str, int]
    failures: list[str]
    long_every_s: float = 0.0
    executors: dict[str, dict[str, float]] = field(default_factory=dict)  # step_summary

    def figures(self) -> dict[str, object]:
        lo, hi = self.window
        inside = lambda t: lo <= t <= hi  # noqa: E731
        gaps = [b - a for r in self.records for a, b in zip(r.times, r.times[1:]) if inside(a) and inside(b)]
        decode_gaps = [
            b - a
            for r in self.records
            if r.kind == "decode"
            for a, b in zip(r.times, r.times[1:])
            if inside(a) and inside(b)
        ]
        tokens = sum(c for r in self.records for t, c in zip(r.times, r.counts) if inside(t))

        def ttft(kind: str) -> list[float]:
            return [r.times[0] - r.arrival for r in self.records if r.kind == kind and r.times and inside(r.arrival)]

        longs = [r for r in self.records if r.kind == "long" and inside(r.arrival)]
        return {
            "mode": self.mode,
            "roles": list(self.roles),
            "window_s": hi - lo,
            "long_every_s": self.long_every_s,
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / (hi - lo) if hi > lo else 0.0,
            "itl_ms": percentiles(gaps, 1e3),
            "itl_samples": len(gaps),
            "decode_stream_itl_ms": percentiles(decode_gaps, 1e3),
            "ttft_long_ms": percentiles(ttft("long"), 1e3),
            "ttft_decode_stream_ms": percentiles(ttft("decode"), 1e3),
            "long_requests": len(longs),
            "long_requests_started": sum(1 for r in longs if r.times),
            "decode_requests": sum(1 for r in self.records if r.kind == "decode" and inside(r.arrival)),
            "counters": self.counters,
            "executors": self.executors,
            "failures": self.failures,
        }


def _request(prompt: list[int], max_tokens: int, rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _drive(
    address: str, w: PdWorkload, every: float, vocab: Vocab, seed: int
) -> tuple[list[Record], float, list[str]]:
    """The workload against one deployment; returns the records, the start (wall clock) and failures."""
    records: list[Record] = []
    failures: list[str] = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await _one(stub, Record("warm", 0.0), _ids(random.Random(seed), vocab, 8), 2, "pd-warm", 0.0, failures)
        t0, wall0 = time.perf_counter(), time.time()
        stop = asyncio.Event()

        async def stream(i: int) -> None:
            rng = random.Random(seed * 7919 + i)
            await asyncio.sleep(i * min(1.0, w.warmup_s / 2) / max(1, w.decode_streams))
            k = 0
            while not stop.is_set():
                out = rng.randint(max(2, w.decode_output_len // 2), max(2, w.decode_output_len * 3 // 2))
                rec = Record("decode", time.perf_counter() - t0)
                records.append(rec)
                await _one(stub, rec, _ids(rng, vocab, w.decode_prompt_len), out, f"pd-d{i}-{k}", t0, failures)
                k += 1

        async def long(k: int, at: float) -> None:
            rng = random.Random(seed * 104729 + k)
            prompt = _ids(rng, vocab, w.long_prompt_len)
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            if stop.is_set():
                return
            rec = Record("long", time.perf_counter() - t0)
            records.append(rec)
            await _one(stub, rec, prompt, w.long_output_len, f"pd-l{k}", t0, failures)

        streams = [asyncio.create_task(stream(i)) for i in range(w.decode_streams)]
        longs = [asyncio.create_task(long(k, at)) for k, at in enumerate(w.long_arrivals(every))]
        end = w.warmup_s + w.window_s
        await asyncio.sleep(max(0.0, t0 + end - time.perf_counter()))
        # The window's long prompts may still wait for their first token: give them time (the streams go on).
        grace = time.perf_counter() + w.first_token_grace_s
        while time.perf_counter() < grace and any(
            r.kind == "long" and not r.times and r.arrival <= end for r in records
        ):
            await asyncio.sleep(0.1)
        stop.set()
        for t in [*streams, *longs]:
            t.cancel()
        await asyncio.gather(*streams, *longs, return_exceptions=True)
    return records, wall0, failures


async def _one(
    stub: pb_grpc.GenerationStub,
    rec: Record,
    prompt: list[int],
    max_tokens: int,
    rid: str,
    t0: float,
    failures: list[str],
) -> None:
    try:
        async for resp in stub.Generate(_request(prompt, max_tokens, rid)):
            if resp.token_ids:
                rec.times.append(time.perf_counter() - t0)
                rec.counts.append(len(resp.token_ids))
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            failures.append(f"{rid}: {exc.code().name}: {exc.details()}")


async def _counters(url: str, ns: str) -> dict[str, int]:
    """The executors' move counters, summed, and what the prefill executor handed over."""
    client = aioredis.from_url(url, decode_responses=True)
    keys = Keys(ns)
    out: dict[str, int] = {}
    try:
        for e in await client.zrange(keys.members, 0, -1):
            for k, v in (await client.hgetall(keys.executor(e).counters)).items():
                if k in ("migrations_disagg", "handoff_blocks", "migrations_in", "migrations_failed"):
                    out[k] = out.get(k, 0) + int(v)
    finally:
        await client.aclose()
    return out


def scheduler_args(w: PdWorkload) -> tuple[str, ...]:
    return (
        "--max-num-batched-tokens",
        str(w.chunk_tokens),
        "--disagg-min-prompt-tokens",
        str(w.min_prompt_tokens),
        "--no-peer-prefix",  # nothing is shared: no asks
    )


def _run(
    address: str, url: str, ns: str, mode: str, w: PdWorkload, every: float, vocab: Vocab, seed: int, steps: Path
) -> RunResult:
    records, wall0, failures = asyncio.run(_drive(address, w, every, vocab, seed))
    counters = asyncio.run(_counters(url, ns))
    window = (w.warmup_s, w.warmup_s + w.window_s)
    per = step_summary(steps, wall0 + window[0], wall0 + window[1], asyncio.run(_roles(url, ns)))
    return RunResult(mode, ROLES[mode], records, window, counters, failures, every, per)


async def _roles(url: str, ns: str) -> dict[str, str]:
    client = aioredis.from_url(url, decode_responses=True)
    keys = Keys(ns)
    try:
        return {
            e: await client.hget(keys.member(e), "role") or "mixed" for e in await client.zrange(keys.members, 0, -1)
        }
    finally:
        await client.aclose()


def step_summary(path: Path, lo: float, hi: float, roles: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per executor (by role, then id), from the scheduler's step log over the window: steps, the mean running
    requests and tokens a step, and the mean and p99 of the executor's own step time."""
    rows = read_log(path)
    out: dict[str, dict[str, float]] = {}
    for e in sorted({r["executor"] for r in rows}):
        mine = [r for r in rows if r["executor"] == e and lo <= r["t"] <= hi]
        if not mine:
            continue
        ms = [r["step_ms"] for r in mine]
        out[f"{roles.get(e, '?')}:{e[:8]}"] = {
            "steps": len(mine),
            "running_mean": statistics.fmean(r["running"] for r in mine),
            "tokens_per_step_mean": statistics.fmean(r["scheduled_tokens"] for r in mine),
            "step_ms_mean": statistics.fmean(ms),
            "step_ms_p99": float(np.percentile(ms, 99)),
        }
    return out


def run_modelled(model_dir: Path, fit: StepFit, w: PdWorkload, mode: str, log_dir: Path, seed: int) -> RunResult:
    """One mode on stub executors whose steps and pulls take the fitted times."""
    log_dir.mkdir(parents=True, exist_ok=True)
    redis_srv = RedisServer()
    ns = f"{NAMESPACE}-{mode}"
    services: list[Service] = []
    try:

        def stub(i: int, role: str) -> Service:
            port = free_port()
            args = ["--model", str(model_dir), "--host", "127.0.0.1", "--role", role]
            args += ["--step-model", fit.step_model(), "--pull-model", fit.pull_model()]
            args += ["--redis-url", redis_srv.url, "--advertise-address", f"127.0.0.1:{port}", "--namespace", ns]
            args += ["--num-gpu-blocks", str(w.kv_cache_tokens // BLOCK_SIZE), "--block-size", str(BLOCK_SIZE)]
            return Service("benchmarks.stub_executor", args, port, log_dir / f"stub-{i}-{role}.log")

        def scheduler() -> Service:
            args = ["--redis-url", redis_srv.url, "--namespace", ns, *scheduler_args(w)]
            args += ["--step-log", str(log_dir / "steps.jsonl")]
            return Service("scheduler_svc", args, free_port(), log_dir / "scheduler.log")

        roles = ROLES[mode]
        services = start_all([*(lambda i=i, r=r: stub(i, r) for i, r in enumerate(roles)), scheduler])
        _await_members(redis_srv.url, ns, len(roles))
        vocab = Vocab.from_model_dir(model_dir)
        steps = log_dir / "steps.jsonl"
        return _run(services[-1].address, redis_srv.url, ns, mode, w, w.every_s(fit), vocab, seed, steps)
    finally:
        stop_all(services)
        redis_srv.stop()


def run_real(model_dir: Path, fit: StepFit, w: PdWorkload, mode: str, log_dir: Path, seed: int) -> RunResult:
    """One mode on real executors of the model (sharing this machine's cores)."""
    ns = f"{NAMESPACE}-real-{mode}"
    max_len = max(w.long_prompt_len + w.long_output_len, w.decode_prompt_len + w.decode_output_len * 3 // 2) + 16
    dep = start_stack(
        model_dir,
        StackConfig(
            w.kv_cache_tokens * kv_bytes_per_token(model_dir),
            BLOCK_SIZE,
            # --drain-timeout 0: stopped at the end, an executor exits at once (a prefill executor would wait
            # for its last lends to end).
            executor_args=("--max-model-len", str(max_len), "--swap-space", "0.25", "--drain-timeout", "0"),
            scheduler_args=scheduler_args(w),
            executors=2,
            namespace=ns,
            roles=ROLES[mode],
            step_log=log_dir / "steps.jsonl",
        ),
        log_dir,
    )
    try:
        _await_members(dep.redis.url, ns, 2)
        vocab = Vocab.from_model_dir(model_dir)
        steps = log_dir / "steps.jsonl"
        return _run(dep.address, dep.redis.url, ns, mode, w, w.every_s(fit), vocab, seed, steps)
    finally:
        dep.stop()


def _await_members(url: str, ns: str, n: int, timeout_s: float = 60.0) -> None:
    """Both executors registered with a usage view (their loops have stepped), so placement sees both."""

    async def wait() -> None:
        client = aioredis.from_url(url, decode_responses=True)
        try:
            deadline = time.monotonic() + timeout_s
            while await client.hlen(Keys(ns).usage) < n:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{n} executors never showed up in namespace {ns}")
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    asyncio.run(wait())


# ---------------------------------------------------------------------------------------------- the arm
@dataclass(slots=True)
class PdResult:
    fit: StepFit | None = None
    runs: dict[str, dict[str, dict[str, object]]] = field(default_factory=dict)  # scale name -> mode -> figures
    config: dict[str, object] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    walls: dict[str, float] = field(default_factory=dict)  # seconds per part (the fit, each run with its start)

    @staticmethod
    def _ratio(runs: dict[str, dict[str, object]], key: str, pct: str | None) -> float | None:
        if set(runs) != set(MODES):
            return None
        a, b = runs["disagg"][key], runs["mixed"][key]
        if pct is not None:
            a, b = a[pct], b[pct]  # type: ignore[index]
        if not isinstance(a, int | float) or not isinstance(b, int | float) or not b or a != a or b != b:
            return None
        return float(a) / float(b)

    def keys(self) -> dict[str, object]:
        """``pd_itl_p99_ratio``, ``pd_throughput_ratio``, ``pd_ttft_p50_ratio`` (disaggregated / mixed) for the
        modelled scale, and with ``_light`` and ``_real`` for the others (null when one did not run)."""
        out: dict[str, object] = {}
        for suffix in ("", "_light", "_real"):
            runs = self.runs.get(suffix, {})
            out[f"pd_itl_p99_ratio{suffix}"] = self._ratio(runs, "itl_ms", "p99")
            out[f"pd_throughput_ratio{suffix}"] = self._ratio(runs, "output_tokens_per_s", None)
            out[f"pd_ttft_p50_ratio{suffix}"] = self._ratio(runs, "ttft_long_ms", "p50")
        return out

    def as_dict(self) -> dict[str, object]:
        return {
            "step_model": asdict(self.fit) if self.fit else None,
            "scales": {name.strip("_") or "modelled": runs for name, runs in self.runs.items()},
            "wall_s": self.walls,
            "config": self.config,
            "errors": self.errors,
        }


def run(model_dir: Path, cfg: PdConfig, log_dir: Path) -> PdResult:
    out = PdResult(config=asdict(cfg))
    t = time.monotonic()
    fit = out.fit = calibrate(model_dir, cfg.fit, log_dir / "fit", cfg.seed)
    out.walls["fit"] = round(time.monotonic() - t, 1)
    (log_dir / "fit" / "step_model.json").write_text(json.dumps(asdict(fit), indent=2))
    for scale in cfg.scales:
        label = scale.name.strip("_") or "modelled"
        runs = out.runs[scale.name] = {}
        for mode in MODES:
            where, t = log_dir / f"{label}-{mode}", time.monotonic()
            if scale.stub:
                r = run_modelled(model_dir, fit, scale.workload, mode, where, cfg.seed)
            else:
                r = run_real(model_dir, fit, scale.workload, mode, where, cfg.seed)
            runs[mode] = r.figures()
            out.walls[f"{label}-{mode}"] = round(time.monotonic() - t, 1)
            out.errors += [f"{label} {mode}: {f}" for f in r.failures[:3]]
        if not runs["disagg"]["counters"].get("migrations_disagg"):  # type: ignore[attr-defined]
            out.errors.append(f"{label}: the prefill executor handed no request over (nothing disaggregated)")
    return out


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--logs", default="/tmp/pagedserve-pd")
    p.add_argument("--window", type=float, default=40.0, help="the modelled scale's window (s)")
    p.add_argument("--light-window", type=float, default=30.0, help="the light scale's window (s; 0: none)")
    p.add_argument("--real-window", type=float, default=30.0, help="the real scale's window (s; 0: none)")
    a = p.parse_args()
    cfg = PdConfig(tuple(scales(a.window, a.light_window, a.real_window)))
    r = run(Path(a.model), cfg, Path(a.logs))
    print(json.dumps({**r.keys(), **r.as_dict()}, indent=2, default=str))


if __name__ == "__main__":
    main()
