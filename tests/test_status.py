"""``pagedserve status`` / ``pagedserve top`` (pagedserve/cli/deployment.py, status.py, top.py): the
snapshot built from plain data, the reader against a real Redis seeded by hand, and both commands on a
real deployment of two tiny-Llama executors: pool sizes and usage while requests run, ``draining``
during a drain.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from rich.console import Console

from pagedserve.cli import deployment, status, top
from pagedserve.cli import main as cli_main
from pagedserve.keys import Keys
from pagedserve.members import ClusterView, Member, Registry
from pagedserve.tiers import Tier
from scheduler_svc.core.placement import PoolView
from scheduler_svc.state.codec import view_json
from tests.conftest import make_cluster
from tests.helpers import greedy
from tests.test_failover import run_in_background

IDENTITY = {"model_digest": "d1", "block_size": "16", "dtype": "float32", "model": "tiny"}


def member(
    eid: str, state: str = "serving", digest: str = "d1", evacuate_at_ms: int = 0, role: str = "mixed"
) -> Member:
    return Member(
        eid,
        f"10.0.0.{eid[-1]}:50061",
        "tiny",
        digest,
        "float32",
        16,
        (32, 100, 0),
        512,
        state,
        evacuate_at_ms,
        role=role,
    )


def view(eid: str, free: tuple[int, int, int], running: int, swapped: int) -> str:
    return view_json(PoolView(eid, True, 16, (32, 100, 0), free, running, swapped, 512, 8, 1, {0: 32 - free[0]}))


def raw(now: int = 1_000_000, **over: object) -> deployment.Raw:
    """Two executors led by two replicas (a third replica's heartbeat expired), one draining, one
    refused (another model), one record expired and one pool view nobody registered."""
    cv = ClusterView(
        members={
            "e1": member("e1"),
            "e2": member("e2", "draining", evacuate_at_ms=now + 5000, role="decode"),
            "e3": member("e3", digest="other"),
        },
        dead=["e4"],
        identity=dict(IDENTITY),
        replicas=2,
    )
    r = deployment.Raw(
        "ns",
        cv,
        usage={
            "e1": view("e1", (8, 100, 0), 3, 0),
            "e2": view("e2", (24, 90, 0), 1, 2),
            "e5": view("e5", (32, 100, 0), 0, 0),
        },
        leaders={"e1": "host-1-aa", "e2": "host-2-bb", "e3": None, "e4": None},
        counters={
            "e1": {"steps": "40", "preemptions_swap": "2"},
            "e2": {"steps": "10", "preemptions_recompute": "1"},
            "e3": {},
            "e4": {},
            "e5": {},
        },
        placed={"e1": 4, "e2": 3, "e3": 0, "e4": 1, "e5": 0},
        lent={"e2": ["r7@1700000000000", "r8@1700000000001/pre", "fetch/r9"]},  # e2 lends two, fetches one
        totals={"steps": "50", "preemptions_swap": "2", "preemptions_recompute": "1"},
        waiting=5,
        live=12,
        attached=11,
        replicas=[("host-1-aa", now + 3000), ("host-2-bb", now + 10), ("host-3-cc", now - 10)],
        now_ms=now,
    )
    for k, v in over.items():
        setattr(r, k, v)
    return r


# -- the pure part ---------------------------------------------------------------


def test_snapshot_from_plain_data() -> None:
    snap = deployment.build(raw())
    assert [e.id for e in snap.executors] == ["e1", "e2", "e3", "e4", "e5"], "membership order, then dead, then views"
    assert [e.state for e in snap.executors] == ["serving", "draining", "refused", "dead", "left"]
    e1, e2, e3, e4, _ = snap.executors
    assert e1.blocks == (32, 100, 0) and e1.free == (8, 100, 0) and e1.kv_usage == 0.75
    assert (e1.lent, e1.fetching, e2.lent, e2.fetching) == (0, 0, 2, 1), "lends out and fetches in, apart"
    assert (e1.role, e2.role) == ("mixed", "decode")
    text = status._text(status.to_json(snap))
    assert "draining (decode)" in text and "fetching 1" in text and "migrating 2" in text
    assert (e1.running, e1.swapped, e1.placed, e1.max_num_seqs) == (3, 0, 4, 8)
    assert e1.leader == "host-1-aa" and e1.counter("steps") == 40 and e1.counter("preemptions_recompute") == 0
    assert e2.usage(Tier.CPU) == 0.1 and e2.usage(Tier.DISK) is None, "an empty tier has no usage"
    assert e3.free is None and e3.kv_usage is None and e3.running is None, "no loop published its pool"
    assert e3.blocks == (32, 100, 0), "sizes from the membership record meanwhile"
    assert e4.address == "" and e4.placed == 1 and e4.blocks == (0, 0, 0), "an expired record: sizes unknown"
    assert snap.model == "tiny" and (snap.waiting, snap.live, snap.attached) == (5, 12, 11)
    assert [(r.id, r.alive, r.leads) for r in snap.replicas] == [
        ("host-1-aa", True, ("e1",)),
        ("host-2-bb", True, ("e2",)),
        ("host-3-cc", False, ()),
    ]
    assert not snap.counts_tokens


def test_a_lease_held_by_a_replica_without_heartbeat_is_listed() -> None:
    snap = deployment.build(raw(replicas=[]))
    assert [(r.id, r.alive, r.leads) for r in snap.replicas] == [
        ("host-1-aa", False, ("e1",)),
        ("host-2-bb", False, ("e2",)),
    ]


def test_json_shape() -> None:
    doc = status.to_json(deployment.build(raw()))
    json.dumps(doc)  # plain JSON
    assert set(doc) == {"namespace", "model", "at_ms", "executors", "queue", "replicas", "totals"}
    e1 = doc["executors"][0]
    assert e1 == {
        "id": "e1",
        "address": "10.0.0.1:50061",
        "model": "tiny",
        "state": "serving",
        "leader": "host-1-aa",
        "role": "mixed",
        "block_size": 16,
        "blocks": {"device": 32, "cpu": 100, "disk": 0},
        "free": {"device": 8, "cpu": 100, "disk": 0},
        "kv_usage": 0.75,
        "running": 3,
        "swapped": 0,
        "max_num_seqs": 8,
        "placed": 4,
        "migrating": 0,
        "fetching": 0,
        "steps": 40,
        "generated": None,
        "preemptions": {"swap": 2, "recompute": 0},
        "swapped_blocks": {"out": 0, "in": 0, "disk_spilled": 0},
        "spec_decode": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0},
        "moves": {
            "out": {"drain": 0, "rebalance": 0, "preempt": 0},
            "in": 0,
            "failed": 0,
            "precopied_blocks": 0,
            "peer_prefix_blocks": 0,
            "peer_prefix_asks": 0,
        },
        "evacuate_at_ms": 0,
    }
    assert doc["executors"][2]["free"] is None and doc["executors"][2]["kv_usage"] is None
    assert doc["queue"] == {"waiting": 5, "live": 12, "attached": 11}
    assert doc["replicas"][0] == {"id": "host-1-aa", "alive": True, "leads": ["e1"]}
    t = doc["totals"]
    assert t["executors"] == 5 and t["blocks"]["device"] == 4 * 32 and t["free"]["device"] == 8 + 24 + 32
    assert (t["running"], t["swapped"], t["placed"], t["steps"]) == (4, 2, 8, 50)
    assert t["preemptions"] == {"swap": 2, "recompute": 1} and "rates" not in t


def test_rates_between_two_snapshots() -> None:
    before = deployment.build(raw(now=1_000_000))
    later = raw(now=1_002_000)
    later.counters = {
        **later.counters,
        "e1": {"steps": "140", "preemptions_swap": "4", "preemptions_recompute": "2"},
        "e2": {"steps": "5"},
    }  # e2's counters went back (reaped, state rebuilt): no rate
    later.totals = {"steps": "150", "preemptions_swap": "4", "preemptions_recompute": "3"}
    later.usage = {k: v for k, v in later.usage.items() if k != "e5"}
    later.view.members["e6"] = member("e6")
    after = deployment.build(later)
    per, total = deployment.rates(before, after)
    assert per["e1"] == deployment.Rate(50.0, None, 2.0), "tokens/s unknown without a generated counter"
    assert per["e2"].steps_per_s is None
    assert "e6" not in per and "e5" not in per
    assert total == deployment.Rate(50.0, None, 2.0)
    doc = status.to_json(after, (per, total))
    assert doc["executors"][0]["rates"] == {"steps_per_s": 50.0, "tokens_per_s": None, "preemptions_per_s": 2.0}
    assert [e["rates"] for e in doc["executors"] if e["id"] == "e6"] == [None]
    assert doc["totals"]["rates"]["steps_per_s"] == 50.0


def test_tokens_per_second_once_commits_count_them() -> None:
    before = raw(now=0)
    before.totals = {**before.totals, deployment.GENERATED: "100"}
    before.counters = {**before.counters, "e1": {"steps": "40", deployment.GENERATED: "100"}}
    after = raw(now=500)
    after.totals = {**after.totals, deployment.GENERATED: "300"}
    after.counters = {**after.counters, "e1": {"steps": "40", deployment.GENERATED: "300"}}
    a, b = deployment.build(before), deployment.build(after)
    assert b.counts_tokens
    per, total = deployment.rates(a, b)
    assert per["e1"].tokens_per_s == 400.0 and per["e2"].tokens_per_s == 0.0 and total.tokens_per_s == 400.0
    assert status.to_json(b)["executors"][0]["generated"] == 300


def test_render_shows_every_executor_and_replica() -> None:
    a = deployment.build(raw(now=1_000_000))
    b = deployment.build(raw(now=1_001_000))
    wide = Console(record=True, width=160, color_system=None)
    wide.print(top.render(b, deployment.rates(a, b)))
    text = wide.export_text()
    for needle in (
        "e1",
        "e2",
        "e3",
        "e4",
        "e5",
        "10.0.0.1:50061",
        "draining 5s",
        "refused",
        "dead",
        "left",
        "75%",
        "24/32",
        "host-1-aa",
        "host-3-cc",
        "expired",
        "5 waiting",
        "12 unfinished",
        "steps/s",
    ):
        assert needle in text, needle
    assert "██████░░  75%" in text, "a 75% KV usage bar"
    narrow = Console(record=True, width=80, color_system=None)
    narrow.print(top.render(b))
    text = narrow.export_text()
    assert max(map(len, text.splitlines())) <= 80 and "10.0.0.1" not in text, "no addresses on 80 columns"
    assert "preempt" in text and "e5" in text
    unled = Console(record=True, width=120, color_system=None)
    unled.print(top.render(deployment.build(raw(leaders={"e1": None, "e2": "host-2-bb"}))))
    assert [ln.split() for ln in unled.export_text().splitlines() if ln.startswith("(none)")] == [["(none)", "-", "e1"]]
    speculating = raw()
    speculating.totals.update(spec_draft_tokens="40", spec_accepted_tokens="30")
    wide.print(top.render(deployment.build(speculating)))
    assert "speculative decoding: 30 of 40 drafted tokens accepted (75%)" in wide.export_text()
    assert status.to_json(deployment.build(speculating))["totals"]["spec_decode"]["accepted_tokens"] == 30


# -- the reader, against a real Redis seeded by hand ---------------------------------


def test_reader_reads_the_documented_keys(redis_url: str) -> None:
    ns = "status-seeded"
    keys = Keys(ns)
    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    sync.delete(*(sync.keys("{" + ns + "}:*") or ["-"]))

    async def go() -> deployment.Deployment:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        reg = Registry(client, keys)
        for eid in ("a1", "a2"):
            await reg.register(member(eid, "draining" if eid == "a2" else "serving"), 10_000)
        await reg.fix_identity(member("a1"))
        await reg.beat_replica("rep-1", 10_000)
        snap = await deployment.read(client, keys)
        await client.aclose()
        return snap

    sync.hset(keys.usage, mapping={"a1": view("a1", (16, 100, 0), 2, 0)})
    sync.set(keys.executor("a1").leader, "rep-1")
    sync.hset(keys.executor("a1").counters, mapping={"steps": 7, "preemptions_swap": 1})
    sync.sadd(keys.executor("a1").live, "r1", "r2")
    sync.hset(keys.counters, mapping={"steps": 9})
    sync.zadd(keys.queue, {"0000000000000003:r3": 0})
    sync.sadd(keys.live, "r1", "r2", "r3")
    sync.zadd(keys.attached, {"r1": 1, "r2": 1})
    snap = asyncio.run(go())
    a1, a2 = snap.executors
    assert (a1.id, a1.state, a1.leader, a1.kv_usage, a1.running, a1.placed, a1.counter("steps")) == (
        "a1",
        "serving",
        "rep-1",
        0.5,
        2,
        2,
        7,
    )
    assert (a2.id, a2.state, a2.leader, a2.free, a2.placed) == ("a2", "draining", None, None, 0)
    assert (snap.waiting, snap.live, snap.attached, snap.totals) == (1, 3, 2, {"steps": 9})
    assert [(r.id, r.alive, r.leads) for r in snap.replicas] == [("rep-1", True, ("a1",))]
    assert snap.model == "tiny"


# -- a real deployment ---------------------------------------------------------------------


def cli(redis_url: str, ns: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", *args, "--redis-url", redis_url, "--namespace", ns],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def status_json(redis_url: str, ns: str, capsys: pytest.CaptureFixture[str] | None = None) -> dict:
    """``pagedserve status --json``: a subprocess, or with ``capsys`` the same ``main`` in this
    process (a few ms rather than an interpreter's start, to catch short-lived states)."""
    if capsys is None:
        out = cli(redis_url, ns, "status", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)
    capsys.readouterr()
    assert cli_main(["status", "--json", "--redis-url", redis_url, "--namespace", ns]) == 0
    return json.loads(capsys.readouterr().out)


def poll(
    redis_url: str,
    ns: str,
    check: Callable[[dict], bool],
    timeout: float,
    what: str,
    capsys: pytest.CaptureFixture[str] | None = None,
) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        doc = status_json(redis_url, ns, capsys)
        if check(doc):
            return doc
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {json.dumps(doc)}"
        time.sleep(0.05)


def top_live(redis_url: str, ns: str, frames: int) -> tuple[int, str]:
    """``pagedserve top`` on a pseudo-terminal until it has drawn ``frames`` frames, then Ctrl-C:
    (exit status, everything it wrote)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedserve.cli",
            "top",
            "--redis-url",
            redis_url,
            "--namespace",
            ns,
            "--interval",
            "0.3",
        ],
        stdout=slave,
        stderr=slave,
        stdin=slave,
        env={**os.environ, "COLUMNS": "240", "LINES": "60", "TERM": "xterm"},
    )
    os.close(slave)
    out = b""
    start, interrupted = time.monotonic(), False
    try:
        while proc.poll() is None or select.select([master], [], [], 0)[0]:
            if not interrupted and out.count(b"requests:") >= frames:
                proc.send_signal(signal.SIGINT)
                interrupted = True
            assert time.monotonic() - start < 30, f"top did not draw {frames} frames and stop on Ctrl-C: {out!r}"
            if select.select([master], [], [], 0.1)[0]:
                try:
                    out += os.read(master, 1 << 16)
                except OSError:  # the terminal closed
                    break
        return proc.wait(5), out.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_and_top_on_a_live_deployment_and_a_drain(
    tiny_llama: Path, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = "status-live"
    rng = random.Random(4)
    reqs = [
        greedy([rng.randrange(3, 49152) for _ in range(rng.randrange(8, 24))], rng.randrange(200, 240))
        for _ in range(16)
    ]
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=32,
        executors=2,
        executor_args=["--lease-ms", "3000", "--drain-timeout", "10"],
        scheduler_args=["--lease-ms", "3000"],
    ) as cluster:
        worker, results = run_in_background(cluster.address, reqs)
        # While requests run: both executors, their pool sizes, usage and running requests.
        doc = poll(
            redis_url,
            ns,
            lambda d: (
                len(d["executors"]) == 2
                and all((e["running"] or 0) > 0 and (e["kv_usage"] or 0) > 0 for e in d["executors"])
            ),
            60,
            "work on both executors",
        )
        assert doc["namespace"] == ns and doc["model"]
        addresses = {e.address for e in cluster.executors}
        (replica,) = doc["replicas"]
        assert replica["alive"]
        for e in doc["executors"]:
            assert e["state"] == "serving" and e["address"] in addresses
            assert e["blocks"]["device"] == 32 and e["block_size"] == 16 and e["blocks"]["cpu"] > 0
            assert 0 <= e["free"]["device"] < 32 and e["placed"] >= e["running"] > 0
            assert e["leader"] == replica["id"] and e["id"] in replica["leads"]
        assert doc["queue"]["live"] > 0 and doc["totals"]["blocks"]["device"] == 64
        rated = cli(redis_url, ns, "status", "--json", "--interval", "0.5")
        assert rated.returncode == 0, rated.stderr
        rated = json.loads(rated.stdout)
        assert rated["totals"]["rates"]["steps_per_s"] > 0
        assert all(e["rates"]["steps_per_s"] > 0 for e in rated["executors"])

        # SIGTERM one executor that holds requests: it shows as draining until it has left. It is
        # chosen from a fresh read, not the rated one (seconds old on a loaded machine): an executor
        # with nothing placed left at once, before any read could see it draining.
        now = status_json(redis_url, ns, capsys)
        busiest = max(now["executors"], key=lambda e: e["placed"])
        assert busiest["placed"] > 0
        (victim,) = [s for s in cluster.executors if s.address == busiest["address"]]
        victim.proc.send_signal(signal.SIGTERM)
        doc = poll(
            redis_url,
            ns,
            lambda d: any(e["id"] == busiest["id"] and e["state"] == "draining" for e in d["executors"]),
            10,
            "the victim to drain",
            capsys,
        )
        (draining,) = [e for e in doc["executors"] if e["id"] == busiest["id"]]
        assert draining["evacuate_at_ms"] > 0 and draining["address"] == busiest["address"]
        other = [e for e in doc["executors"] if e["id"] != busiest["id"]]
        assert [e["state"] for e in other] == ["serving"]

        # Both views of top render it: one frame, and the live view on a terminal until Ctrl-C.
        once = cli(redis_url, ns, "top", "--once")
        assert once.returncode == 0, once.stderr
        assert all(e["id"][:8] in once.stdout for e in other) and "KV usage" in once.stdout
        if busiest["id"][:8] not in once.stdout:  # it drained and left before top read the membership
            poll(
                redis_url,
                ns,
                lambda d: all(e["state"] == "left" for e in d["executors"] if e["id"] == busiest["id"]),
                10,
                "the victim to have left",
                capsys,
            )
        rc, screen = top_live(redis_url, ns, frames=3)
        assert rc == 0, screen
        # The drained victim may have left by now (its requests moved); the other is there throughout.
        assert "steps/s" in screen and all(e["id"][:12] in screen for e in other)
        assert "tokens/s" in screen, "frames after the first show rates"

        assert victim.proc.wait(timeout=30) == 0
        # Gone from the membership; its pool view may stay published until it is cleaned up ("left").
        doc = poll(
            redis_url,
            ns,
            lambda d: all(e["state"] == "left" for e in d["executors"] if e["id"] == busiest["id"]),
            10,
            "the drained executor to leave",
            capsys,
        )
        assert [e["state"] for e in doc["executors"] if e["id"] == other[0]["id"]] == ["serving"]
        worker.join(120)
        assert not worker.is_alive() and len(results) == len(reqs)
        assert all(r.finish_reason == "length" for r in results)
