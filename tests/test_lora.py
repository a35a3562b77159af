"""Many LoRA adapters on one base model, end to end, on three deployments with --enable-lora:
tiny Llama (one executor, two replicas), tiny Llama on two executors with one adapter slot each
(placement, cluster-wide loading), and SmolLM2, the default model.

The oracle is transformers + PEFT: each adapter's greedy output, served in batches that mix
three adapters and the base model on a small pool (preemption) with prefix caching, is
token-identical to ``PeftModel.from_pretrained(base, path).generate(do_sample=False)``.
Adapters are made here with PEFT (random A and B: ``init_lora_weights=False``). Where a request
ran, and with which adapters beside it, the schedulers' step logs say (``lora_adapters``).
"""

from __future__ import annotations

import asyncio
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
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.cli import deployment, status, top
from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import free_port
from pagedserve.keys import Keys
from pagedserve.lora import read as read_adapter
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests import helpers
from tests.conftest import make_cluster
from tests.helpers import greedy, run_all
from tests.test_e2e_oracle import hf_greedy

NS = "lora"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
rng = random.Random(25)
SHARED = [rng.randrange(3, 49152) for _ in range(32)]  # two blocks every prompt starts with: prefix-cache hits
PROMPTS = [SHARED + [rng.randrange(3, 49152) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
MAX_TOKENS = 40
# Twelve requests of about five blocks each on 24 blocks: preempted and recomputed from the prefix cache.
BLOCKS = 24
SECOND_HTTP = free_port()  # the second scheduler replica's HTTP door


def make_adapter(base_dir: Path, dst: Path, seed: int, r: int = 8, targets: list[str] = ALL) -> Path:
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(dst)
    return dst


def peft_greedy(base_dir: Path, adapter: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny_llama, root / "a", 1),
        "b": make_adapter(tiny_llama, root / "b", 2),
        # another rank and only some layers: zero-padded in its slot, no delta elsewhere
        "c": make_adapter(tiny_llama, root / "c", 3, r=4, targets=["q_proj", "v_proj", "down_proj"]),
        "v1": make_adapter(tiny_llama, root / "v1", 4),
        "v2": make_adapter(tiny_llama, root / "v2", 5),
        "big": make_adapter(tiny_llama, root / "big", 6, r=32, targets=["q_proj"]),
    }


@pytest.fixture(scope="module")
def tiny_steps(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The step logs of the tiny deployment's two replicas (its executor's loop runs on either)."""
    root = tmp_path_factory.mktemp("tiny-steps")
    return [root / "steps-0.jsonl", root / "steps-1.jsonl"]


@pytest.fixture(scope="module")
def cluster(
    tiny_llama: Path,
    redis_url: str,
    adapters: dict[str, Path],
    tiny_steps: list[Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    """One executor, two scheduler replicas (each with an HTTP door); a and b from --lora-modules."""
    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]
    with make_cluster(
        tiny_llama,
        redis_url,
        NS,
        tmp_path_factory.mktemp("logs"),
        blocks=BLOCKS,
        http_port=free_port(),
        executor_args=[*lora, "--max-cpu-loras", "4"],
        scheduler_args=[
            *lora,
            "--lora-modules",
            f"a={adapters['a']}",
            f"b={adapters['b']}",
            "--step-log",
            str(tiny_steps[0]),
        ],
    ) as cluster:
        cluster.start_scheduler(["--http-port", str(SECOND_HTTP), *lora, "--step-log", str(tiny_steps[1])])
        yield cluster


@pytest.fixture(scope="module")
def r(cluster: Cluster) -> redis.Redis:
    return redis.Redis.from_url(cluster.redis_url, decode_responses=True)


def http(cluster: Cluster, port: int | None = None) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port or cluster.http_port}", timeout=120)


def on(adapter: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    req = greedy(ids, max_tokens)
    req.lora_name = adapter
    return req


def hits(r: redis.Redis) -> int:
    return helpers.counters(r, NS).get("prefix_cache_hits", 0)


def test_three_adapters_and_the_base_model_in_one_batch_match_peft(
    cluster: Cluster, r: redis.Redis, adapters: dict[str, Path], tiny_llama: Path, tiny_steps: list[Path]
) -> None:
    # c is registered through the second replica's HTTP door, then used through the first replica's gRPC.
    with http(cluster, SECOND_HTTP) as h:
        got = h.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
        assert got.status_code == 200, got.text
    names = ["a", "b", "c", ""]
    reqs = [on(name, ids) for ids in PROMPTS for name in names]
    before = helpers.counters(r, NS)
    results = run_all(cluster.address, reqs)
    after = helpers.counters(r, NS)
    want = {name: peft_greedy(tiny_llama, adapters[name], PROMPTS, MAX_TOKENS) for name in "abc"}
    want[""] = hf_greedy(tiny_llama, PROMPTS, [MAX_TOKENS] * len(PROMPTS))
    for i in range(len(PROMPTS)):
        for name in names:
            res = results[i * len(names) + names.index(name)]
            assert res.token_ids == want[name][i], f"adapter {name or 'base'!r}, prompt {i}"
    assert len({tuple(want[n][0]) for n in names}) == 4, "the adapters change the output (else this tests nothing)"
    assert after.get("preemptions_recompute", 0) > before.get("preemptions_recompute", 0), "the small pool preempted"
    assert after.get("prefix_cache_hits", 0) > before.get("prefix_cache_hits", 0), "the shared prefix hit"
    assert mixes_all(steps_since(tiny_steps, 0), 3), "some step ran all three adapters and the base model"


def mixes_all(rows: list[dict], adapters: int) -> bool:
    """Whether some step ran ``adapters`` adapters and the base model."""
    return any(len(row["lora_adapters"]) == adapters and row["seqs"] > row["lora_seqs"] for row in rows)


def test_new_weights_under_an_old_name_never_reuse_its_kv(
    cluster: Cluster, r: redis.Redis, adapters: dict[str, Path], tiny_llama: Path, tmp_path: Path
) -> None:
    place = tmp_path / "tenant"
    shutil.copytree(adapters["v1"], place)
    prompt = [rng.randrange(3, 49152) for _ in range(40)]  # two full blocks cached after a first run
    with http(cluster) as h:
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "t", "lora_path": str(place)}).status_code == 200
        run_all(cluster.address, [on("t", prompt)])
        start = hits(r)
        assert (
            run_all(cluster.address, [on("t", prompt)])[0].token_ids
            == peft_greedy(tiny_llama, adapters["v1"], [prompt], MAX_TOKENS)[0]
        )
        assert hits(r) - start == 32, "the same adapter hits its own two blocks"
        # New weights written over the same directory, re-registered under the same name.
        shutil.rmtree(place)
        shutil.copytree(adapters["v2"], place)
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "t", "lora_path": str(place)}).status_code == 200
        start = hits(r)
        got = run_all(cluster.address, [on("t", prompt)])[0].token_ids
        assert hits(r) == start, "no hit from the old weights' KV"
        assert got == peft_greedy(tiny_llama, adapters["v2"], [prompt], MAX_TOKENS)[0]
        # Another name for the same weights shares their KV.
        assert (
            h.post("/v1/load_lora_adapter", json={"lora_name": "t2", "lora_path": str(adapters["v2"])}).status_code
            == 200
        )
        start = hits(r)
        assert run_all(cluster.address, [on("t2", prompt)])[0].token_ids == got
        assert hits(r) - start == 32, "two names, one adapter: one cache"


def test_the_http_door_selects_an_adapter_by_model_and_lists_them(
    cluster: Cluster, adapters: dict[str, Path], tiny_llama: Path
) -> None:
    ids = PROMPTS[0]
    with http(cluster) as h:
        models = h.get("/v1/models").json()["data"]
        base = models[0]["id"]
        cards = {m["id"]: m for m in models}
        assert (
            cards["a"]["parent"] == base and cards["b"]["parent"] == base and cards["a"]["root"] == str(adapters["a"])
        )
        body = {"model": "b", "prompt": ids, "max_tokens": 8, "temperature": 0}
        got = h.post("/v1/completions", json=body).json()
        assert got["model"] == "b"
        want = peft_greedy(tiny_llama, adapters["b"], [ids], MAX_TOKENS)[0][:8]
        assert got["choices"][0]["text"] == AutoTokenizer.from_pretrained(tiny_llama).decode(want), got
        assert h.post("/tokenize", json={"model": "b", "prompt": "hi"}).status_code == 200, "the adapter's tokenizer"
    deadline = time.monotonic() + 15  # the executor's record is rewritten every third of its lease
    while "b" not in (shown := asyncio.run(status.status(cluster.redis_url, NS))["executors"][0]["lora_adapters"]):  # type: ignore[index]
        assert time.monotonic() < deadline, f"pagedserve status does not show b (last used) in its slots: {shown}"
        time.sleep(0.5)
    # by name; t and t2 (the same weights) would show as t|t2, an unregistered digest by its first 12 digits
    assert set(shown) - {"b"} <= {"a", "c", "t|t2"} | {s for s in shown if len(s) == 12}, shown
    frame = Console(record=True, width=200, color_system=None)
    frame.print(top.render(asyncio.run(deployment.read(deployment.connect(cluster.redis_url), Keys(NS)))))
    text = frame.export_text()
    rows = [line.split() for line in text.splitlines() if "serving" in line]
    assert rows and "b" in rows[0][-1].split(","), f"pagedserve top's last column shows them too: {text}"
    exported = "".join(http(cluster, port).get("/metrics").text for port in (cluster.http_port, SECOND_HTTP))
    info = [line for line in exported.splitlines() if "lora_requests_info{" in line]
    assert info and 'max_lora="3"' in info[0] and "running_lora_adapters=" in info[0], info


def test_unknown_adapters_and_ranks_over_the_limit_are_refused(cluster: Cluster, adapters: dict[str, Path]) -> None:
    with http(cluster) as h:
        got = h.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
        assert got.status_code == 404, got.text
        err = got.json()["error"]
        assert err["code"] == "model_not_found" and "nope" in err["message"]
        got = h.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapters["big"])})
        assert got.status_code == 400 and "exceeds --max-lora-rank 16" in got.text, got.text
        got = h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
        assert got.status_code == 400 and "lora_path" in got.text, got.text
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404
    with grpc.insecure_channel(cluster.address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(on("nope", [5, 6, 7]), timeout=30))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in (exc.value.details() or "")
        stub.LoadLoraAdapter(pb.LoraAdapterRequest(lora_name="gone", lora_path=str(adapters["a"])), timeout=30)
        stub.UnloadLoraAdapter(pb.LoraAdapterRequest(lora_name="gone"), timeout=30)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(on("gone", [5, 6, 7]), timeout=30))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND


# -- two executors, one adapter slot each: placement and cluster-wide loading ----------------------

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
def pair(
    tiny_llama: Path, redis_url: str, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """Two executors with one adapter slot each (--max-loras 1: a slot is scarce, so placement must
    find it), two scheduler replicas (each with a step log and an HTTP door); a, b and c registered
    at start. A short lease, so each executor's record (its slots) reaches placement within a second."""
    logs = tmp_path_factory.mktemp("pair")
    model = long_context(tiny_llama, logs / "model")
    steps = [logs / "steps-0.jsonl", logs / "steps-1.jsonl"]
    lora = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "16", "--lease-ms", "3000"]
    modules = [f"{n}={adapters[n]}" for n in "abc"]
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


def steps_since(paths: list[Path], t: float) -> list[dict]:
    """The step logs' lines (both replicas: each writes its loops' steps) from ``t`` on."""
    rows = []
    for path in paths:
        whole = path.read_text().rpartition("\n")[0] if path.exists() else ""  # a line being written waits
        rows += [json.loads(line) for line in whole.splitlines()]
    return [row for row in rows if row["t"] >= t]


def ran_on(rows: list[dict], adapter: str) -> set[str]:
    """The executors whose steps ran ``adapter``."""
    return {row["executor"] for row in rows if adapter in row["lora_adapters"]}


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
    with http(cluster, SECOND_HTTP_PAIR) as h:
        got = h.post("/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": str(adapters["v1"])})
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
    want = peft_greedy(pair.model, adapters["v1"], [list(q.prompt_token_ids) for q in first + second], MAX_TOKENS)
    assert [s.token_ids for s in served] == want, "e's output, wherever it ran, is PEFT's"


# -- SmolLM2 on a real stack -------------------------------------------------------------------------

SMOL = "lora-smol"
SMOL_TOKENS = 24
# Twelve requests of 3 blocks (prompt) growing to 4-5, on 32 blocks: about ten start at once, so they mix every
# adapter and the base model (ten of the twelve hold some of each kind), then outgrow the pool; the newest are
# preempted and recomputed, hitting the prefix cache (each adapter's two shared blocks and their own).
SMOL_BLOCKS = 32


def make_adapters(base_dir: Path, root: Path, specs: dict[str, tuple[int, int, list[str]]]) -> dict[str, Path]:
    """PEFT adapters ``name: (seed, rank, targets)`` on one loaded base model (random A and B)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for name, (seed, r, targets) in specs.items():
        torch.manual_seed(seed)
        peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False))
        peft.save_pretrained(root / name)
        model = peft.unload()
    return {name: root / name for name in specs}


def peft_greedy_each(
    base_dir: Path, paths: dict[str, Path], prompts: list[list[int]], max_tokens: int
) -> dict[str, list[list[int]]]:
    """``peft_greedy`` for several adapters on one loaded base model (``set_adapter`` picks each)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    (first, path), *rest = paths.items()
    model = PeftModel.from_pretrained(base, path, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    model.eval()
    out: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        for name in paths:
            model.set_adapter(name)
            out[name] = []
            for ids in prompts:
                gen = model.generate(
                    input_ids=torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                )
                out[name].append(gen[0, len(ids) :].tolist())
    return out


@dataclass(frozen=True, slots=True)
class Smol:
    cluster: Cluster
    steps: Path  # its scheduler's step log
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def smol(smol_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Smol]:
    """SmolLM2 with three adapters from --lora-modules (two of rank 8 on every target, one of rank 4 on
    three), on a pool small enough to preempt."""
    root = tmp_path_factory.mktemp("smol")
    paths = make_adapters(
        smol_dir, root, {"s0": (10, 8, ALL), "s1": (11, 8, ALL), "s2": (12, 4, ["q_proj", "v_proj", "down_proj"])}
    )
    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
    steps = root / "steps.jsonl"
    with make_cluster(
        smol_dir,
        redis_url,
        SMOL,
        root / "logs",
        blocks=SMOL_BLOCKS,
        executor_args=lora,
        scheduler_args=[*lora, "--lora-modules", *(f"{n}={p}" for n, p in paths.items()), "--step-log", str(steps)],
    ) as cluster:
        yield Smol(cluster, steps, paths)


def test_smollm2_three_adapters_and_the_base_model_in_one_batch_match_peft_under_preemption(
    smol: Smol, smol_dir: Path
) -> None:
    """The default model (30 layers, tied embeddings) end to end: each adapter's greedy output is
    transformers + PEFT's, in steps that mix three adapters and the base model, through recompute
    preemptions and prefix-cache hits."""
    r = redis.Redis.from_url(smol.cluster.redis_url, decode_responses=True)
    names = ["s0", "s1", "s2", ""]
    before = helpers.counters(r, SMOL)
    results = run_all(smol.cluster.address, [on(name, ids, SMOL_TOKENS) for ids in PROMPTS for name in names])
    after = helpers.counters(r, SMOL)
    want = peft_greedy_each(smol_dir, smol.adapters, PROMPTS, SMOL_TOKENS)
    want[""] = hf_greedy(smol_dir, PROMPTS, [SMOL_TOKENS] * len(PROMPTS))
    for i in range(len(PROMPTS)):
        for j, name in enumerate(names):
            assert results[i * len(names) + j].token_ids == want[name][i], f"adapter {name or 'base'!r}, prompt {i}"
    assert len({tuple(want[n][0]) for n in names}) == 4, "the adapters change the output (else this tests nothing)"
    assert after.get("preemptions_recompute", 0) > before.get("preemptions_recompute", 0), "the small pool preempted"
    assert after.get("prefix_cache_hits", 0) > before.get("prefix_cache_hits", 0), "the shared prefix hit"
    assert mixes_all(steps_since([smol.steps], 0), 3), "some step ran all three adapters and the base model"
