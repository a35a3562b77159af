"""Chaos: every fault at once, under load, and nothing lost (issue #27).

One namespace: Redis with an AOF (``appendfsync always``), 3 tiny-Llama executors with small pools, 2 scheduler
replicas. Client threads stream requests through the resuming client (``pagedserve.client.generate``) against
both replicas: greedy, shared-prefix greedy, seeded sampled, ``n=2`` seeded sampled, and structured output. A seeded
schedule of faults runs meanwhile, one after another with seeded pauses, every kind once per round in a seeded
order: executor SIGKILL, executor drain (SIGTERM; it must exit 0), an executor joining, executor SIGSTOP past its
lease (then SIGCONT), replica SIGKILL and restart on its port, Redis SIGKILL and restart from its AOF.

Checks: every request completes; greedy completions equal transformers'; seeded and structured ones equal the same
request run alone on the calm stack before the faults; each completion's tokens arrive exactly once (offsets
contiguous per index); no error reaches a caller; at the end nothing is live and every pool is free.

``tests/test_chaos.py`` runs one round; ``make chaos SEED=… DURATION=…`` runs ``python -m tests.chaos``, rounds until
DURATION seconds have passed, and writes the JSON summary (``Tally.summary``). The seed is printed first, so a
failure reproduces (the schedule, victims and requests follow it; process timing does not).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from pagedserve import client as lib
from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import RedisServer, Service
from pagedserve.keys import Keys
from pagedserve.v1 import generation_pb2 as pb
from tests.helpers import block_bytes, pool_state

KINDS = ("executor_kill", "executor_drain", "executor_join", "executor_stop", "replica_kill", "redis_kill")
EXECUTORS, REPLICAS, POOL_BLOCKS = 3, 2, 24
LEASE = ["--lease-ms", "3000"]
DRAIN_S = 8  # --drain-timeout: a drain that outlasts it recomputes the rest elsewhere
STOP_S = 7.0  # SIGSTOP: past the lease (3 s) and the loop's --executor-timeout (4 s)
MAX_OUT = 48
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}

_rng = random.Random(27)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(_rng.randrange(5, 40))] for _ in range(8)]
_PREFIX = [_rng.randrange(3, 49152) for _ in range(40)]  # two and a half blocks, shared
SHARED = [_PREFIX + [_rng.randrange(3, 49152) for _ in range(_rng.randrange(3, 10))] for _ in range(4)]


# ---- the schedule (plain data) ----


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    victim: int  # index into the live executors (or replicas), sorted by address, modulo their number
    pause_s: float  # quiet time after the fault and its recovery


def schedule(seed: int, pause: tuple[float, float] = (2.0, 6.0)) -> Iterator[list[Fault]]:
    """Rounds of faults: each round every kind once, in a seeded order, with seeded victims and pauses."""
    rng = random.Random(seed)
    while True:
        kinds = list(KINDS)
        rng.shuffle(kinds)
        yield [Fault(k, rng.randrange(1 << 16), round(rng.uniform(*pause), 2)) for k in kinds]


# ---- the requests ----


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of the load: ``kind`` says how its answer is checked."""

    kind: str  # greedy | prefix (checked against transformers) | seeded | group | structured (against a calm run)
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None = None
    n: int = 1

    def request(self, request_id: str) -> pb.GenerateRequest:
        s = pb.SamplingParams(max_tokens=self.max_tokens, temperature=0.0)
        if self.seed is not None:
            s.temperature, s.top_k, s.seed = 0.9, 50, self.seed
        if self.n > 1:
            s.n = self.n
        if self.kind == "structured":
            s.structured_output.json_schema = json.dumps(SCHEMA)
        return pb.GenerateRequest(request_id=request_id, prompt_token_ids=list(self.prompt), sampling=s)


# Requests whose answer is a calm run's: a fixed pool, each run alone once before the faults.
CALMED = [
    *(Spec("seeded", tuple(PROMPTS[i]), 40, seed=s) for i in range(4) for s in (11, 12)),
    *(Spec("group", tuple(PROMPTS[i]), 40, seed=21, n=2) for i in (4, 5)),
    *(Spec("structured", tuple(PROMPTS[i]), 40) for i in (6, 7)),
]
ORACLE_PROMPTS = [*PROMPTS, *SHARED]


def draw(rng: random.Random) -> Spec:
    """The next request of one client."""
    kind = rng.choice(("greedy", "greedy", "prefix", "seeded", "group", "structured"))
    if kind == "greedy":
        return Spec(kind, tuple(rng.choice(PROMPTS)), rng.randrange(8, MAX_OUT + 1))
    if kind == "prefix":
        return Spec(kind, tuple(rng.choice(SHARED)), rng.randrange(8, MAX_OUT + 1))
    return rng.choice([s for s in CALMED if s.kind == kind])


def completions(responses: list[pb.GenerateResponse], n: int) -> tuple[dict[int, list[int]], int, int, int]:
    """Each completion's tokens as the caller received them, and the (duplicates, gaps, unfinished) among them:
    a message repeating tokens or arriving after its completion ended, a message past the next expected offset,
    a completion that never ended."""
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    ended: set[int] = set()
    dup = gap = 0
    for r in responses:
        mine = tokens.setdefault(r.index, [])
        if r.index in ended or r.offset < len(mine):
            dup += 1
            continue
        if r.offset > len(mine):
            gap += 1
        mine += r.token_ids
        if r.finish_reason:
            ended.add(r.index)
    return tokens, dup, gap, len(set(tokens) - ended)


# ---- the tally ----


@dataclass(slots=True)
class Tally:
    seed: int
    started: float = field(default_factory=time.monotonic)
    requests: int = 0
    tokens: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    duplicates: int = 0
    gaps: int = 0
    errors: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    fault_errors: list[str] = field(default_factory=list)
    leaked_blocks: int = -1
    live_at_end: int = -1
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, fault: str, at: float) -> None:
        with self.lock:
            self.faults[fault] += 1
        print(f"chaos: {time.monotonic() - self.started:7.1f}s {fault} ({at:.1f}s)", flush=True)

    def summary(self) -> dict[str, object]:
        return {
            "seed": self.seed,
            "duration_s": round(time.monotonic() - self.started, 1),
            "requests": self.requests,
            "requests_by_kind": dict(sorted(self.by_kind.items())),
            "tokens": self.tokens,
            "faults": {k: self.faults[k] for k in KINDS},
            "faults_total": sum(self.faults.values()),
            "mismatches": len(self.mismatches),
            "duplicates": self.duplicates,
            "gaps": self.gaps,
            "errors": len(self.errors),
            "incomplete": len(self.incomplete),
            "fault_errors": len(self.fault_errors),
            "leaked_blocks": self.leaked_blocks,
            "live_at_end": self.live_at_end,
            "details": {
                "mismatches": self.mismatches[:20],
                "errors": self.errors[:20],
                "incomplete": self.incomplete[:20],
                "fault_errors": self.fault_errors[:20],
            },
        }

    @property
    def clean(self) -> bool:
        s = self.summary()
        bad = ("mismatches", "duplicates", "gaps", "errors", "incomplete", "fault_errors", "leaked_blocks")
        return all(s[k] == 0 for k in bad) and s["live_at_end"] == 0 and self.requests > 0


# ---- the stack and its faults ----


class Stack:
    """The deployment under test and the faults applied to it, one at a time (from one thread)."""

    def __init__(self, model: Path, log_dir: Path, namespace: str = "chaos", keep: int = EXECUTORS) -> None:
        self.keep = keep  # executors kept running after a kill or drain (replacements join)
        self.redis = RedisServer(appendfsync="always")
        self.namespace = namespace
        self.scheduler_args = [*LEASE, "--executor-timeout", "4"]
        self.cluster = Cluster(
            str(model),
            kv_cache_memory=POOL_BLOCKS * block_bytes(model),
            executor_args=[*LEASE, "--drain-timeout", str(DRAIN_S)],
            scheduler_args=self.scheduler_args,
            redis_url=self.redis.url,
            log_dir=log_dir,
            namespace=namespace,
            executors=EXECUTORS,
        )
        for _ in range(REPLICAS - 1):
            self.cluster.start_scheduler(self.scheduler_args)
        self.addresses = [s.address for s in self.cluster.schedulers]
        self.client = redis.Redis.from_url(self.redis.url, decode_responses=True)
        self.drains: list[threading.Thread] = []

    def close(self) -> None:
        for t in self.drains:
            t.join(DRAIN_S + 30)
        self.cluster.close()
        self.redis.stop()

    def _executors(self) -> list[Service]:
        return sorted((s for s in self.cluster.executors if s.proc.poll() is None), key=lambda s: s.address)

    def apply(self, fault: Fault, tally: Tally) -> None:
        t0 = time.monotonic()
        getattr(self, fault.kind)(fault.victim, tally)
        tally.note(fault.kind, time.monotonic() - t0)

    def _replace(self) -> None:
        """Keep ``keep`` executors running after one left (a join beyond them is the ``executor_join`` fault's)."""
        if len(self._executors()) < self.keep:
            self.cluster.add_executor()

    def executor_kill(self, victim: int, tally: Tally) -> None:
        live = self._executors()
        svc = live[victim % len(live)]
        svc.proc.kill()
        svc.proc.wait()
        self.cluster.executors.remove(svc)
        self._replace()

    def executor_drain(self, victim: int, tally: Tally) -> None:
        live = self._executors()
        svc = live[victim % len(live)]
        svc.proc.send_signal(signal.SIGTERM)
        self.cluster.executors.remove(svc)

        def wait() -> None:
            try:
                rc = svc.proc.wait(DRAIN_S + 30)
            except Exception as exc:  # noqa: BLE001 - recorded: a drain that never ends is a finding
                tally.fault_errors.append(f"drain of {svc.address}: {exc!r}")
                svc.proc.kill()
                return
            if rc != 0:
                tally.fault_errors.append(f"drain of {svc.address} exited {rc}")

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        self.drains.append(thread)
        self._replace()

    def executor_join(self, victim: int, tally: Tally) -> None:
        self.cluster.add_executor()

    def executor_stop(self, victim: int, tally: Tally) -> None:
        live = self._executors()
        svc = live[victim % len(live)]
        svc.proc.send_signal(signal.SIGSTOP)
        time.sleep(STOP_S)
        svc.proc.send_signal(signal.SIGCONT)

    def replica_kill(self, victim: int, tally: Tally) -> None:
        old = self.cluster.schedulers[victim % len(self.cluster.schedulers)]
        for child in psutil.Process(old.proc.pid).children(recursive=True):
            child.kill()
        old.proc.kill()
        old.proc.wait()
        self.cluster.schedulers.remove(old)
        port = int(old.address.rsplit(":", 1)[1])
        self.cluster.start_scheduler(self.scheduler_args, port=port)

    def redis_kill(self, victim: int, tally: Tally) -> None:
        self.redis.kill()
        time.sleep(0.2 + (victim % 8) / 8)
        self.redis.restart()

    def settle(self, tally: Tally, timeout: float = 120) -> None:
        """After the load: wait for nothing live and every pool free; record what is left."""
        keys = Keys(self.namespace)
        deadline = time.monotonic() + timeout
        while True:
            live = self.client.scard(keys.live)
            leaked = sum(_leaked(self.client, self.namespace, e) for e in sorted(self.client.hkeys(keys.usage)))
            if (live == 0 and leaked == 0) or time.monotonic() > deadline:
                tally.live_at_end, tally.leaked_blocks = live, leaked
                return
            time.sleep(0.2)


def _leaked(client: redis.Redis, namespace: str, executor: str) -> int:
    free, totals = pool_state(client, namespace, executor)
    return sum(totals) - sum(free)


# ---- the load ----


class Load:
    """``clients`` threads, each drawing requests from its own seeded stream until ``stop`` is set, streaming them
    through the resuming client against both replicas, and checking each answer as it ends."""

    def __init__(
        self,
        addresses: list[str],
        oracle: dict[tuple[int, ...], list[int]],
        calm: dict[Spec, dict[int, list[int]]],
        tally: Tally,
        clients: int,
    ) -> None:
        self.addresses, self.oracle, self.calm, self.tally = addresses, oracle, calm, tally
        self.stop = threading.Event()
        self.current: dict[int, str] = {}
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        rng = random.Random(self.tally.seed * 1000 + i)
        addresses = self.addresses[i % 2 :] + self.addresses[: i % 2]
        k = 0
        while not self.stop.is_set():
            spec, rid = draw(rng), f"chaos-{self.tally.seed}-{i}-{k}"
            k += 1
            self.current[i] = rid
            self.check(spec, rid, run(addresses, spec, rid, self.tally))
        self.current.pop(i, None)

    def check(self, spec: Spec, rid: str, responses: list[pb.GenerateResponse] | None) -> None:
        if responses is None:
            return  # an error, recorded by run()
        got, dup, gap, unfinished = completions(responses, spec.n)
        if spec.kind in ("greedy", "prefix"):
            want = {0: self.oracle[spec.prompt][: spec.max_tokens]}
        else:
            want = self.calm[spec]
        t = self.tally
        with t.lock:
            t.requests += 1
            t.by_kind[spec.kind] += 1
            t.tokens += sum(len(v) for v in got.values())
            t.duplicates += dup
            t.gaps += gap
            if unfinished:
                t.incomplete.append(f"{rid}: {unfinished} completion(s) without a finish_reason")
            if got != want:
                ends = {r.index: r.finish_reason for r in responses if r.finish_reason}
                t.mismatches.append(f"{rid} ({spec.kind}): got {got} want {want} finish {ends}")

    def join(self, timeout: float) -> None:
        """Stop drawing; wait for the requests in flight, recording those that never end."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.tally.incomplete += [f"{rid}: still streaming after the load stopped" for rid in self.current.values()]


def run(addresses: list[str], spec: Spec, rid: str, tally: Tally | None) -> list[pb.GenerateResponse] | None:
    """Stream one request through the resuming client; its responses, or None after an error (recorded)."""
    try:
        return list(lib.generate(addresses, spec.request(rid)))
    except Exception as exc:  # noqa: BLE001 - every error reaching a caller is a finding
        if tally is None:
            raise
        with tally.lock:
            tally.errors.append(f"{rid} ({spec.kind}): {exc!r}"[:500])
        return None


# ---- the run ----


def calm_answers(addresses: list[str]) -> dict[Spec, dict[int, list[int]]]:
    """Each calmed request run alone, one after another, before any fault."""
    out = {}
    for j, spec in enumerate(CALMED):
        responses = run(addresses, spec, f"calm-{j}", None)
        assert responses is not None
        got, dup, gap, unfinished = completions(responses, spec.n)
        assert (dup, gap, unfinished) == (0, 0, 0), f"the calm run of {spec} is not whole"
        out[spec] = got
    return out


def chaos(model: Path, seed: int, duration_s: float, log_dir: Path, clients: int = 6, keep: int = EXECUTORS) -> Tally:
    """Run the load and rounds of faults until ``duration_s`` has passed (at least one whole round), then check.
    ``keep``: executors kept running after a kill or a drain (1: no replacements, the suite's short round)."""
    from tests.test_e2e_oracle import hf_greedy

    print(f"chaos: seed {seed}, {duration_s:.0f} s, logs in {log_dir}", flush=True)
    oracle = dict(zip(map(tuple, ORACLE_PROMPTS), hf_greedy(model, ORACLE_PROMPTS, [MAX_OUT] * len(ORACLE_PROMPTS))))
    tally = Tally(seed)
    stack = Stack(model, log_dir, keep=keep)
    try:
        calm = calm_answers(stack.addresses)
        tally.started = time.monotonic()
        load = Load(stack.addresses, oracle, calm, tally, clients)
        for faults in schedule(seed):
            for fault in faults:
                try:
                    stack.apply(fault, tally)
                except Exception as exc:  # noqa: BLE001 - the harness's own failure is reported, not hidden
                    tally.fault_errors.append(f"{fault.kind}: {exc!r}"[:500])
                time.sleep(fault.pause_s)
            if time.monotonic() - tally.started >= duration_s:
                break
        load.join(timeout=300)
        stack.settle(tally)
    finally:
        stack.close()
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="schedule and load seed (default: random, printed)")
    p.add_argument("--duration", type=float, default=900, help="seconds of faults (whole rounds; default 900)")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--out", type=Path, default=None, help="JSON summary (default .cache/chaos-SEED.json)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seed = args.seed if args.seed is not None else random.randrange(1 << 20)
    from executor_svc.model_store import resolve_model
    from tests.conftest import build_tiny

    work = Path(tempfile.mkdtemp(prefix=f"pagedserve-chaos-{seed}-"))
    model = build_tiny("llama", work / "tiny-llama", resolve_model(None))
    tally = chaos(model, seed, args.duration, work / "logs", args.clients)
    out = args.out or Path(".cache") / f"chaos-{seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(tally.summary(), indent=1) + "\n")
    print(json.dumps({k: v for k, v in tally.summary().items() if k != "details"}), flush=True)
    print(f"chaos: seed {seed}: {'clean' if tally.clean else 'FAILED'}; summary in {out}", flush=True)
    return 0 if tally.clean else 1


if __name__ == "__main__":
    sys.exit(main())
