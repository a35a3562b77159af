"""Many LoRA adapters on one base model, end to end: tiny Llama with --enable-lora, one executor and
two scheduler replicas (tests/test_lora_placement.py has two executors, tests/test_lora_smollm2.py the
default model).

The oracle is transformers + PEFT (``tests/lora_support.py``): each adapter's greedy output, served in
batches that mix three adapters and the base model on a small pool (preemption) with prefix caching,
is token-identical to ``PeftModel.from_pretrained(base, path).generate(do_sample=False)``.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from rich.console import Console
from transformers import AutoTokenizer

from pagedserve.cli import deployment, status, top
from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import free_port
from pagedserve.keys import Keys
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests import helpers
from tests.conftest import make_cluster
from tests.helpers import run_all
from tests.lora_support import MAX_TOKENS, PROMPTS, make_adapter, mixes_all, on, peft_greedy, steps_since
from tests.test_e2e_oracle import hf_greedy

NS = "lora"
rng = random.Random(26)
# Twelve requests of about five blocks each on 24 blocks: preempted and recomputed from the prefix cache.
BLOCKS = 24
SECOND_HTTP = free_port()  # the second scheduler replica's HTTP door


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
            "--preemption-mode",
            "recompute",  # preempted requests come back through the prefix cache (what this module checks)
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
    want = {name: peft_greedy(tiny_llama, adapters[name], PROMPTS, MAX_TOKENS) for name in "abc"}
    want[""] = hf_greedy(tiny_llama, PROMPTS, [MAX_TOKENS] * len(PROMPTS))
    # First one request on each: the four fit the pool together at full length (4 x 5 blocks of 24), so they run
    # side by side whatever order they arrive in. Under the preempting batch below, which of them run together
    # depends on how the steps fell.
    start = time.time()
    for name, res in zip(names, run_all(cluster.address, [on(name, PROMPTS[1]) for name in names])):
        assert res.token_ids == want[name][1], f"adapter {name or 'base'!r}, alone in the pool"
    assert mixes_all(steps_since(tiny_steps, start), 3), "some step ran all three adapters and the base model"
    reqs = [on(name, ids) for ids in PROMPTS for name in names]
    before = helpers.counters(r, NS)
    results = run_all(cluster.address, reqs)
    after = helpers.counters(r, NS)
    for i in range(len(PROMPTS)):
        for name in names:
            res = results[i * len(names) + names.index(name)]
            assert res.token_ids == want[name][i], f"adapter {name or 'base'!r}, prompt {i}"
    assert len({tuple(want[n][0]) for n in names}) == 4, "the adapters change the output (else this tests nothing)"
    assert after.get("preemptions_recompute", 0) > before.get("preemptions_recompute", 0), "the small pool preempted"
    assert after.get("prefix_cache_hits", 0) > before.get("prefix_cache_hits", 0), "the shared prefix hit"


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
