"""Drain with KV migration against drain with recompute, on real executors.

One run per ``--migration`` mode (``kv``, then ``recompute``), each on its own
fresh deployment: Redis, two executors with the same KV budget, one scheduler
(``benchmarks.stack``). ``requests`` greedy requests with prompts of
``prompt_len`` tokens (``ignore_eos``) stream at once, so each executor holds
about half of them. Once every stream is decoding, the executor holding the
most requests gets SIGTERM. For each stream that was placed on it, the
**stall** is the longest gap in its stream from the SIGTERM on, as the
client sees it (the source decodes on until its loop sees the drain; then
the stream waits for the move); ``drain_s`` is from the SIGTERM to the executor's exit, ``resumed_s`` to
the last moved stream's first token after its stall (the drain's work done elsewhere); the namespace
counter ``moved_recomputed_tokens`` is how many computed tokens lost their KV
by moving (0 when every pull succeeded). Both modes move the same requests at
the same moment: the difference is only whether their KV travels.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from benchmarks.arm_pagedserve import request_pb
from benchmarks.stack import StackConfig, start
from benchmarks.workload import Vocab
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

NAMESPACE = "migration"
MODES = ("kv", "recompute")


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    requests: int = 4
    prompt_len: int = 1024  # context at the move: at least this
    output_len: int = 160
    decoding_tokens: int = 8  # every stream has this many tokens before the SIGTERM
    kv_cache_bytes: int = 512 << 20  # per executor: either one holds all of them
    seed: int = 0


@dataclass(slots=True)
class ModeResult:
    mode: str
    stalls_ms: list[float]  # per stream that was on the drained executor
    drain_s: float  # SIGTERM to the drained executor's exit
    resumed_s: float  # SIGTERM to the last moved stream's first token after its stall: the drain's work done
    moved: int
    recomputed_tokens: int
    migrated_bytes: int
    failures: int
    tokens_identical: bool = True  # every stream's tokens equal the other mode's (filled by ``run``)

    @property
    def stall_p50_ms(self) -> float | None:
        return statistics.median(self.stalls_ms) if self.stalls_ms else None

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "stalls_ms": self.stalls_ms,
            "stall_p50_ms": self.stall_p50_ms,
            "drain_s": self.drain_s,
            "resumed_s": self.resumed_s,
            "moved": self.moved,
            "recomputed_tokens": self.recomputed_tokens,
            "migrated_bytes": self.migrated_bytes,
            "failures": self.failures,
        }


@dataclass(slots=True)
class MigrationResult:
    modes: dict[str, ModeResult] = field(default_factory=dict)
    tokens_identical: bool | None = None

    def keys(self) -> dict[str, object]:
        """The summary.json keys."""
        kv, rc = self.modes.get("kv"), self.modes.get("recompute")
        ratio = None
        if kv and rc and kv.stall_p50_ms is not None and rc.stall_p50_ms:
            ratio = kv.stall_p50_ms / rc.stall_p50_ms
        return {
            "drain_recomputed_tokens": kv.recomputed_tokens if kv else None,
            "drain_recomputed_tokens_recompute_arm": rc.recomputed_tokens if rc else None,
            "migration_stall_ms_p50": kv.stall_p50_ms if kv else None,
            "recompute_stall_ms_p50": rc.stall_p50_ms if rc else None,
            "migration_stall_ratio": ratio,
            "migration_drain_s": kv.drain_s if kv else None,
            "recompute_drain_s": rc.drain_s if rc else None,
            "migration_resumed_s": kv.resumed_s if kv else None,
            "recompute_resumed_s": rc.resumed_s if rc else None,
            "migration_tokens_identical": self.tokens_identical,
        }


def _stall(times: list[float], t0: float, exit_s: float) -> tuple[float, float]:
    """The longest gap in a stream that starts between ``t0`` (the SIGTERM) and the drained executor's exit
    (``exit_s`` later), and when it ended (from ``t0``): its source goes on decoding until its loop sees the
    drain, then the stream waits for the move (lend, claim, pull or recompute) and goes on elsewhere. Gaps
    that start later are the destination's own pace, not the move's."""
    after = [t0, *(t for t in times if t > t0)]
    gaps = [(b - a, b - t0) for a, b in zip(after, after[1:]) if a - t0 <= exit_s]
    return max(gaps, default=(0.0, 0.0))


async def _stream(stub: pb_grpc.GenerationStub, req, times: list[float], tokens: list[int]) -> None:  # type: ignore[no-untyped-def]
    async for resp in stub.Generate(req):
        for t in resp.token_ids:
            times.append(time.perf_counter())
            tokens.append(t)


async def _mode(model_dir: Path, mode: str, cfg: MigrationConfig, log_dir: Path) -> tuple[ModeResult, list[list[int]]]:
    dep = start(
        model_dir,
        StackConfig(
            cfg.kv_cache_bytes,
            executor_args=("--drain-timeout", "300"),
            # The recompute arm recomputes: no peer prefix hit may read the drained executor's cached prompts.
            scheduler_args=("--migration", mode, *(("--no-peer-prefix",) if mode == "recompute" else ())),
            executors=2,
            namespace=NAMESPACE,
        ),
        log_dir / mode,
    )
    keys = Keys(NAMESPACE)
    client = aioredis.from_url(dep.redis.url, decode_responses=True)
    try:
        while await client.hlen(keys.usage) < 2:
            await asyncio.sleep(0.2)
        vocab = Vocab.from_model_dir(model_dir)
        span = vocab.size - vocab.low
        prompts = [
            [vocab.low + (cfg.seed * 7919 + i * 104729 + j * 31) % span for j in range(cfg.prompt_len)]
            for i in range(cfg.requests)
        ]
        rids = [f"mig-{mode}-{i}" for i in range(cfg.requests)]
        times: list[list[float]] = [[] for _ in rids]
        tokens: list[list[int]] = [[] for _ in rids]
        async with grpc.aio.insecure_channel(dep.scheduler.address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            calls = [
                asyncio.create_task(_stream(stub, request_pb(p, cfg.output_len, rid), times[i], tokens[i]))
                for i, (p, rid) in enumerate(zip(prompts, rids))
            ]
            while min(len(t) for t in times) < cfg.decoding_tokens:
                short = [i for i, c in enumerate(calls) if c.done() and len(times[i]) < cfg.decoding_tokens]
                if short:  # refused (too long for the model?) or failed: never wait on a stream that is over
                    for c in calls:
                        c.cancel()
                    exc = calls[short[0]].exception()
                    raise RuntimeError(f"a stream ended before its {cfg.decoding_tokens}th token: {exc!r}")
                await asyncio.sleep(0.01)
            placed = {e: await client.scard(keys.executor(e).live) for e in await client.hkeys(keys.usage)}
            victim_id = max(placed, key=lambda e: placed[e])
            on_victim = [i for i, rid in enumerate(rids) if await client.hget(keys.req(rid), "executor") == victim_id]
            address = await client.hget(keys.member(victim_id), "address")
            (victim,) = [s for s in dep.executors if s.address == address]
            before = await client.hgetall(keys.counters)
            t0 = time.perf_counter()
            victim.proc.send_signal(signal.SIGTERM)
            while victim.proc.poll() is None:
                await asyncio.sleep(0.02)
            drain_s = time.perf_counter() - t0
            results = await asyncio.gather(*calls, return_exceptions=True)
        after = await client.hgetall(keys.counters)

        def delta(name: str) -> int:
            return int(after.get(name, 0)) - int(before.get(name, 0))

        gaps = [_stall(times[i], t0, drain_s) for i in on_victim]
        return ModeResult(
            mode,
            [g * 1e3 for g, _ in gaps],
            drain_s,
            max((end for _, end in gaps), default=0.0),
            len(on_victim),
            delta("moved_recomputed_tokens"),
            delta("migrated_bytes"),
            sum(isinstance(r, BaseException) for r in results),
        ), tokens
    finally:
        await client.aclose()
        dep.stop()


def run(model_dir: Path, cfg: MigrationConfig, log_dir: Path) -> MigrationResult:
    out = MigrationResult()
    seen: list[list[list[int]]] = []
    for mode in MODES:
        result, tokens = asyncio.run(_mode(model_dir, mode, cfg, log_dir))
        out.modes[mode] = result
        seen.append(tokens)
    out.tokens_identical = all(len(t) == cfg.output_len for t in seen[0]) and seen[0] == seen[1]
    return out


def main() -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=160)
    p.add_argument("--logs", default="/tmp/pagedserve-migration")
    a = p.parse_args()
    cfg = MigrationConfig(a.requests, a.prompt_len, a.output_len)
    r = run(Path(a.model), cfg, Path(a.logs))
    print(json.dumps({**r.keys(), "modes": {m: x.as_dict() for m, x in r.modes.items()}}, indent=2))


if __name__ == "__main__":
    main()
