"""LoRA adapters on two executors with one adapter slot each (--max-loras 1), behind two scheduler
replicas: placement by where adapters run and sit, --max-loras per step, and an adapter loaded once
through one replica served by whichever executor its requests land on. Where each adapter ran, the
schedulers' step logs say (``lora_adapters``); requests that hold an executor's one slot keep a phase's
placement certain. The oracle is transformers + PEFT (``tests/lora_support.py``).
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import free_port
from pagedserve.keys import Keys
from pagedserve.lora import read as read_adapter
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests import helpers
from tests.conftest import make_cluster
from tests.helpers import greedy, run_all
from tests.lora_support import MAX_TOKENS, make_adapter, on, peft_greedy, ran_on, steps_since

rng = random.Random(27)
PAIR = "lora-pair"
SECOND_HTTP_PAIR = free_port()
HOLD_TOKENS = 4000  # a hold outlasts a phase of the test by thousands of steps (it is aborted at its end)


@dataclass(frozen=True, slots=True)
class Pair:
    cluster: Cluster
    steps: list[Path]  # the two replicas' step logs
    model: Path


def long_context(tiny_llama: Path, dst: Path) -> Path:
    """Tiny Llama's weights with 4,096 positions (rotary: nothing else changes), so a hold can run long."""
    shutil.copytree(tiny_llama, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    return dst


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny_llama, root / "a", 1),
        "c": make_adapter(tiny_llama, root / "c", 3, r=4, targets=["q_proj", "v_proj", "down_proj"]),
        "e": make_adapter(tiny_llama, root / "e", 4),
    }


@pytest.fixture(scope="module")
def pair(
    tiny_llama: Path, redis_url: str, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """Two executors with one adapter slot each (--max-loras 1: a slot is scarce, so placement must
    find it), two scheduler replicas (each with a step log and an HTTP door); a and c registered at
    start. A short lease, so each executor's record (its slots) reaches placement within a second."""
    logs = tmp_path_factory.mktemp("pair")
    model = long_context(tiny_llama, logs / "model")
    steps = [logs / "steps-0.jsonl", logs / "steps-1.jsonl"]
    lora = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "16", "--lease-ms", "3000"]
    modules = [f"{n}={adapters[n]}" for n in "ac"]
    with make_cluster(
        model,
        redis_url,
        PAIR,
        logs,
        blocks=1024,
        executors=2,
        executor_args=lora,
        scheduler_args=[*lora, "--lora-modules", *modules, "--step-log", str(steps[0])],
    ) as cluster:
        cluster.start_scheduler(["--http-port", str(SECOND_HTTP_PAIR), *lora, "--step-log", str(steps[1])])
        yield Pair(cluster, steps, model)


class Hold:
    """A long request on ``adapter`` (``ignore_eos``), streamed in a thread until ``end`` aborts it:
    it keeps its adapter running, and so its executor's one slot taken."""

    def __init__(self, address: str, rid: str, adapter: str) -> None:
        self.rid, self.finish = rid, ""
        req = greedy([rng.randrange(3, 49152) for _ in range(8)], HOLD_TOKENS, ignore_eos=True)
        req.lora_name, req.request_id = adapter, rid
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.thread = threading.Thread(target=self._drain, args=(req,), daemon=True)
        self.thread.start()

    def _drain(self, req: pb.GenerateRequest) -> None:
        for resp in self.stub.Generate(req, timeout=300):
            self.finish = resp.finish_reason or self.finish

    def where(self, r: redis.Redis) -> str:
        """The executor it runs on, once it runs."""
        deadline = time.monotonic() + 60
        while not (executor := r.hget(Keys(PAIR).req(self.rid), "executor")):
            assert time.monotonic() < deadline and self.thread.is_alive(), f"{self.rid} never ran"
            time.sleep(0.005)
        return str(executor)

    def end(self) -> None:
        """Abort it; it must still have been running (else what it held proves nothing)."""
        self.stub.Abort(pb.AbortRequest(request_id=self.rid), timeout=30)
        self.thread.join(60)
        self.channel.close()
        assert self.finish == "abort", f"{self.rid} ended before the probes did ({self.finish})"


def probes(adapter: str, n: int, max_tokens: int = 16) -> list[pb.GenerateRequest]:
    return [on(adapter, [rng.randrange(3, 49152) for _ in range(rng.randrange(8, 24))], max_tokens) for _ in range(n)]


def digest(path: Path) -> str:
    return read_adapter("x", str(path), 64).digest


def wait_idle(r: redis.Redis) -> None:
    free, total = helpers.wait_all_free(r, PAIR)
    assert free == total, "every request ended and freed its blocks"


def test_adapters_go_where_they_run_then_to_a_free_slot_then_where_they_sit(
    pair: Pair, adapters: dict[str, Path]
) -> None:
    cluster, logs = pair.cluster, pair.steps
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    t0 = time.time()
    hold_a = Hold(cluster.address, "hold-a", "a")
    x = hold_a.where(r)
    hold_base = Hold(cluster.address, "hold-base", "")
    y = hold_base.where(r)
    assert {x, y} == set(helpers.executors(r, PAIR)), "the idle executor takes the base model's request"
    # x runs a in its one slot and holds more KV than y, which runs the base model and has a free slot.
    run_all(cluster.address, probes("a", 2))
    run_all(cluster.address, probes("c", 1))
    hold_a.end()
    hold_base.end()
    rows = steps_since(logs, t0)
    assert ran_on(rows, "a") == {x}, "a's requests join the executor running a, though it is the busier"
    assert ran_on(rows, "c") == {y}, "x has no slot for c: y's free one takes it"
    assert max(row["lora_seqs"] for row in rows if row["executor"] == x) == 3, "the probes ran beside the hold"
    assert max(len(row["lora_adapters"]) for row in rows) == 1, "never more adapters in a step than --max-loras"
    # Idle now, x's slot holds a and y's holds c: each one's next request goes where it sits (loads are
    # equal: without the slots' contents in the views both would go to the same executor).
    wait_idle(r)
    want = {x: [digest(adapters["a"])], y: [digest(adapters["c"])]}
    deadline = time.monotonic() + 30
    while {e: helpers.usage(r, PAIR, e).get("loaded") for e in (x, y)} != want:
        assert time.monotonic() < deadline, "the views never showed the executors' slots"
        time.sleep(0.1)
    t1 = time.time()
    run_all(cluster.address, probes("a", 1))
    run_all(cluster.address, probes("c", 1))
    rows = steps_since(logs, t1)
    assert (ran_on(rows, "a"), ran_on(rows, "c")) == ({x}, {y}), "each adapter's request goes where it sits"


def test_an_adapter_loaded_on_one_replica_is_served_by_whichever_executor_it_lands_on(
    pair: Pair, adapters: dict[str, Path]
) -> None:
    """e is registered once, through the second replica's HTTP door; its requests go through the first
    replica's gRPC door, to one executor while the other's slot is taken, then to the other."""
    cluster, logs = pair.cluster, pair.steps
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    with httpx.Client(base_url=f"http://127.0.0.1:{SECOND_HTTP_PAIR}", timeout=120) as h:
        got = h.post("/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": str(adapters["e"])})
        assert got.status_code == 200, got.text
    first, second = probes("e", 2, MAX_TOKENS), probes("e", 2, MAX_TOKENS)
    t0 = time.time()
    hold_a = Hold(cluster.address, "hold-a2", "a")
    x = hold_a.where(r)
    served = run_all(cluster.address, first)  # x's one slot runs a: they run on the other
    hold_c = Hold(cluster.address, "hold-c2", "c")
    y = hold_c.where(r)
    assert y != x, "x has no slot for c"
    hold_a.end()
    deadline = time.monotonic() + 30
    while r.scard(Keys(PAIR).executor(x).live):
        assert time.monotonic() < deadline, "x never went idle"
        time.sleep(0.02)
    served += run_all(cluster.address, second)  # y's one slot runs c: they run on x
    hold_c.end()
    assert ran_on(steps_since(logs, t0), "e") == {x, y}, "both executors served e"
    want = peft_greedy(pair.model, adapters["e"], [list(q.prompt_token_ids) for q in first + second], MAX_TOKENS)
    assert [s.token_ids for s in served] == want, "e's output, wherever it ran, is PEFT's"
