"""Streams that survive (real processes): a replica killed or rolled, Redis killed and
restarted from its AOF or paused, a client that vanished.

Clients use the library (``pagedserve.client.generate``), which resumes from the
last offset on another replica. Every completion must equal an undisturbed run:
transformers' greedy output, or, for a sampled request submitted without a seed,
the same request run again with the seed the frontend drew and stored.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import grpc
import psutil
import pytest
import redis

from pagedserve import client as lib
from pagedserve.cli import main as cli_main
from pagedserve.dev.procs import RedisServer, Service
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests.conftest import make_cluster
from tests.helpers import greedy, wait_all_free
from tests.test_e2e_oracle import hf_greedy

rng = random.Random(9)
PROMPTS = [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
FAST = ["--lease-ms", "3000"]


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> list[list[int]]:
    return hf_greedy(tiny_llama, PROMPTS, [200] * len(PROMPTS))


def sampled(prompt: list[int], n: int, seed: int | None = None) -> pb.GenerateRequest:
    s = pb.SamplingParams(max_tokens=n, temperature=0.9, top_k=50)
    if seed is not None:
        s.seed = seed
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=s)


class Streams:
    """Each request streamed by the client library on its own thread."""

    def __init__(self, addresses: list[list[str]], reqs: list[pb.GenerateRequest]) -> None:
        self.reqs = [pb.GenerateRequest() for _ in reqs]
        for mine, given in zip(self.reqs, reqs):
            mine.CopyFrom(given)
            mine.request_id = mine.request_id or uuid.uuid4().hex
        self.responses: list[list[pb.GenerateResponse]] = [[] for _ in reqs]
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._one, args=(i, a)) for i, a in enumerate(addresses)]
        for t in self.threads:
            t.start()

    def _one(self, i: int, addresses: list[str]) -> None:
        try:
            for resp in lib.generate(addresses, self.reqs[i], timeout=300):
                self.responses[i].append(resp)
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.errors.append(exc)

    def join(self) -> list[list[int]]:
        for t in self.threads:
            t.join(240)
            assert not t.is_alive(), "a stream did not finish"
        assert not self.errors, self.errors
        out = []
        for responses in self.responses:
            tokens: list[int] = []
            for resp in responses:
                assert resp.offset == len(tokens), "each token exactly once, in order"
                tokens += resp.token_ids
            assert responses[-1].finish_reason
            out.append(tokens)
        return out

    def ids(self) -> list[str]:
        return [r.request_id for r in self.reqs]


def progress(
    client: redis.Redis, ns: str, ids: list[str], tokens: int, *errors: list[BaseException], timeout: float = 120
) -> None:
    """Wait until every request has generated at least ``tokens`` or has ended sooner (a sampled request may draw
    its end of sequence early). The timeout is a bound, not a speed: generous, as two busy test workers share two
    cores. ``errors``: the streams' error lists, so that a stream that failed fails the wait at once, naming why."""
    keys = Keys(ns)
    deadline = time.monotonic() + timeout

    def done(rid: str) -> bool:
        n = client.llen(keys.out(rid))
        return n >= tokens or (n > 0 and not client.sismember(keys.live, rid))

    while not all(done(rid) for rid in ids):
        assert not any(errors), f"a stream failed: {[e for each in errors for e in each]}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


def kill_replica(svc: Service) -> None:
    """SIGKILL a replica's API process and its loop process."""
    for child in psutil.Process(svc.proc.pid).children(recursive=True):
        child.kill()
    svc.proc.kill()
    svc.proc.wait()


def stored_seed(client: redis.Redis, ns: str, rid: str) -> int:
    return json.loads(client.hget(Keys(ns).req(rid), "spec"))["params"]["seed"]


def test_clients_finish_on_the_other_replica_when_theirs_is_killed(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]]
) -> None:
    ns = "streams-kill"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=64, scheduler_args=FAST) as cluster:
        a, b = cluster.scheduler, cluster.start_scheduler(FAST)
        reqs = [greedy(p, 100) for p in PROMPTS[:3]] + [sampled(p, 100) for p in PROMPTS[3:6]]
        streams = Streams([[a.address, b.address]] * 6, reqs)
        progress(client, ns, streams.ids(), 10, streams.errors)
        kill_replica(a)
        got = streams.join()
        assert got[:3] == [e[:100] for e in expected[:3]], "greedy: the transformers reference"
        seeds = [stored_seed(client, ns, rid) for rid in streams.ids()[3:]]
        assert all(isinstance(s, int) for s in seeds), "a sampled request without a seed got one stored"
        again = Streams([[b.address]] * 3, [sampled(p, 100, seed) for p, seed in zip(PROMPTS[3:6], seeds)]).join()
        assert got[3:] == again, "sampled: the same tokens as an undisturbed run with the stored seed"


def test_a_rolling_restart_of_every_replica_loses_nothing(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]]
) -> None:
    ns = "streams-roll"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    slow = [*FAST, "--max-num-seqs", "2"]  # the run outlasts two restarts
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=64, scheduler_args=slow) as cluster:
        cluster.start_scheduler(slow)
        addrs = [s.address for s in cluster.schedulers]
        # One raw stream shows what the library does for us: a drained stream says where to resume.
        channel = grpc.insecure_channel(addrs[0], options=CHANNEL_OPTIONS)
        raw_req = greedy(PROMPTS[0], 512 - len(PROMPTS[0]), ignore_eos=True)  # as long as the model allows
        raw_req.request_id = "raw"
        raw = pb_grpc.GenerationStub(channel).Generate(raw_req, timeout=120)
        raw_tokens = len(next(raw).token_ids)
        streams = Streams([addrs, addrs[::-1]] * 4, [greedy(p, 200) for p in PROMPTS])
        # The threads submit in any order and two run at a time: wait for whichever got the free slot.
        deadline = time.monotonic() + 60
        while max(client.llen(Keys(ns).out(rid)) for rid in streams.ids()) < 3:
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.02)
        assert client.hget(Keys(ns).req("raw"), "status") != "finished", "the raw stream is still running"
        for i, old in enumerate(list(cluster.schedulers)):
            port = int(old.address.rsplit(":", 1)[1])
            old.proc.send_signal(signal.SIGTERM)
            assert old.proc.wait(timeout=30) == 0
            if i == 0:
                with pytest.raises(grpc.RpcError) as info:
                    for resp in raw:
                        raw_tokens += len(resp.token_ids)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                trailer = dict(info.value.trailing_metadata())
                assert int(trailer["pagedserve-offset"]) == raw_tokens and trailer["pagedserve-request-id"] == "raw"
                assert client.hget(Keys(ns).req("raw"), "status") != "finished", "draining aborts nothing"
                with grpc.insecure_channel(addrs[1], options=CHANNEL_OPTIONS) as other:
                    assert pb_grpc.GenerationStub(other).Abort(pb.AbortRequest(request_id="raw")).found
            cluster.start_scheduler(slow, port=port)
            cluster.schedulers.remove(old)
        channel.close()
        assert streams.join() == expected


@pytest.mark.parametrize("outage", ["aof-always", "aof-everysec", "sigstop"])
def test_streams_survive_a_redis_outage(
    outage: str, tiny_llama: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    server = RedisServer(appendfsync=outage.removeprefix("aof-") if outage.startswith("aof") else None)
    ns = "streams-redis"
    try:
        with make_cluster(tiny_llama, server.url, ns, tmp_path, blocks=64, scheduler_args=FAST) as cluster:
            client = redis.Redis.from_url(server.url, decode_responses=True)
            streams = Streams([[cluster.address]] * 6, [greedy(p, 200) for p in PROMPTS[:6]])
            progress(client, ns, streams.ids(), 20, streams.errors)
            if outage == "sigstop":
                server.proc.send_signal(signal.SIGSTOP)
                time.sleep(5)
                server.proc.send_signal(signal.SIGCONT)
            else:
                server.kill()
                time.sleep(0.5)
                server.restart()
            assert streams.join() == expected[:6]
            free, totals = wait_all_free(client, ns)
            assert free == totals
    finally:
        server.stop()


def test_streams_survive_redis_losing_its_last_seconds(
    tiny_llama: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    """Redis restarts from an AOF seconds old: placements, tokens, a whole request are gone. Loops
    notice (the executor has run plans past what Redis holds) and recompute; the frontend submits the
    lost request again; replayable seeds regenerate the same tokens; offsets drop what clients have."""
    server = RedisServer(appendfsync="always")
    ns = "streams-rollback"
    aof = Path(server.dir) / "appendonly.aof"
    try:
        with make_cluster(tiny_llama, server.url, ns, tmp_path, blocks=32, scheduler_args=FAST) as cluster:
            client = redis.Redis.from_url(server.url, decode_responses=True)
            first = Streams(
                [[cluster.address]] * 4, [greedy(p, 200) for p in PROMPTS[:2]] + [sampled(p, 200) for p in PROMPTS[2:4]]
            )
            progress(client, ns, first.ids(), 20, first.errors)
            old = aof.read_bytes()  # the state Redis will come back to
            late = Streams([[cluster.address]] * 2, [greedy(PROMPTS[4], 200), sampled(PROMPTS[5], 200)])
            progress(client, ns, first.ids() + late.ids(), 40, first.errors, late.errors)
            server.kill()
            aof.write_bytes(old)
            server.restart()
            got = first.join() + late.join()
            assert [got[i] for i in (0, 1, 4)] == [expected[i] for i in (0, 1, 4)]
            ids = first.ids() + late.ids()
            seeds = [stored_seed(client, ns, ids[i]) for i in (2, 3, 5)]
            again = Streams(
                [[cluster.address]] * 3, [sampled(PROMPTS[i], 200, seed) for i, seed in zip((2, 3, 5), seeds)]
            ).join()
            assert [got[i] for i in (2, 3, 5)] == again
            log = (tmp_path / "scheduler-0.log").read_text()
            assert "recompute" in log and "submitting it again" in log, "the rollback was noticed and healed"
            free, totals = wait_all_free(client, ns)
            assert free == totals
    finally:
        server.stop()


def test_a_vanished_clients_request_is_aborted_a_resumed_one_completes(
    tiny_llama: Path, redis_url: str, tmp_path: Path, expected: list[list[int]]
) -> None:
    ns = "streams-detach"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    args = [*FAST, "--detach-timeout", "2", "--max-num-seqs", "2"]
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=64, scheduler_args=args) as cluster:
        a, b = cluster.scheduler, cluster.start_scheduler(args)
        channel = grpc.insecure_channel(a.address, options=CHANNEL_OPTIONS)
        stub = pb_grpc.GenerationStub(channel)
        long = pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)  # outlives the window
        calls = [
            stub.Generate(
                pb.GenerateRequest(
                    request_id="kept",
                    prompt_token_ids=PROMPTS[0],
                    sampling=pb.SamplingParams(max_tokens=200, temperature=0),
                )
            ),
            stub.Generate(pb.GenerateRequest(request_id="vanished", prompt_token_ids=PROMPTS[1], sampling=long)),
        ]
        for c in calls:
            next(c)
        kill_replica(a)  # both clients lose their stream; nobody cancels anything
        channel.close()
        # "kept" comes back within the window, through the library (Generate: ALREADY_EXISTS, so Resume).
        kept = lib.generate(
            [b.address],
            pb.GenerateRequest(
                request_id="kept",
                prompt_token_ids=PROMPTS[0],
                sampling=pb.SamplingParams(max_tokens=200, temperature=0),
            ),
        )
        assert [t for r in kept for t in r.token_ids] == expected[0]
        keys = Keys(ns)
        deadline = time.monotonic() + 30
        while client.hget(keys.req("vanished"), "status") != "finished":
            assert time.monotonic() < deadline, "the detached request was never aborted"
            time.sleep(0.2)
        assert client.hget(keys.req("vanished"), "finish_reason") == "abort"
        assert client.llen(keys.out("vanished")) < 400
        free, totals = wait_all_free(client, ns)
        assert free == totals


def by_completion(responses: list[pb.GenerateResponse]) -> tuple[dict[int, list[int]], set[int]]:
    """Each completion's tokens, checking each arrived exactly once and in order, and nothing after its end."""
    tokens: dict[int, list[int]] = {}
    ended: set[int] = set()
    for r in responses:
        mine = tokens.setdefault(r.index, [])
        assert r.index not in ended, f"completion {r.index}: a message after its finish_reason"
        assert r.offset == len(mine), f"completion {r.index}: each token exactly once, in order"
        mine += r.token_ids
        if r.finish_reason:
            ended.add(r.index)
    return tokens, ended


def grouped(prompt: list[int], max_tokens: int, seed: int, n: int, request_id: str) -> pb.GenerateRequest:
    req = sampled(prompt, max_tokens, seed)
    req.sampling.n, req.request_id = n, request_id
    return req


def test_the_client_streams_every_completion_of_a_group_whole_through_a_replica_kill(
    tiny_llama: Path, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sampling.n``: the client keeps an offset per completion, ends when all have, and resumes each
    unfinished one from its own offset (Resume.index). Completion i samples with seed + i, so it must
    equal the same request alone with that seed."""
    ns = "streams-group"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with make_cluster(tiny_llama, redis_url, ns, tmp_path, blocks=64, scheduler_args=FAST) as cluster:
        a, b = cluster.scheduler, cluster.start_scheduler(FAST)
        calm, ended = by_completion(list(lib.generate(b.address, grouped(PROMPTS[7], 30, 99, 2, "calm"))))
        assert ended == {0, 1}, "on a calm stack too, the stream ends only when every completion has"
        capsys.readouterr()
        argv = ["generate", "--address", b.address, "--raw", "--json", "--n", "2", "-n", "8", "-t", "1", "Hello"]
        assert cli_main(argv) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        cli_tokens, cli_ended = by_completion([pb.GenerateResponse(**line) for line in lines])
        assert cli_ended == {0, 1} and all(cli_tokens[i] for i in (0, 1)), "the CLI streams both completions whole"
        responses: list[pb.GenerateResponse] = []
        errors: list[BaseException] = []

        def stream() -> None:
            try:
                responses.extend(lib.generate([a.address, b.address], grouped(PROMPTS[6], 100, 1234, 3, "group")))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=stream)
        thread.start()
        progress(client, ns, [f"group#{i}" for i in range(3)], 10, errors)
        kill_replica(a)
        thread.join(240)
        assert not thread.is_alive() and not errors, errors
        got, ended = by_completion(responses)
        assert ended == {0, 1, 2}
        alone = Streams([[b.address]] * 5, [sampled(PROMPTS[6], 100, 1234 + i) for i in range(3)]
                        + [sampled(PROMPTS[7], 30, 99 + i) for i in range(2)]).join()  # fmt: skip
        assert [got[i] for i in range(3)] == alone[:3], "each completion as its own request alone"
        assert [calm[i] for i in range(2)] == alone[3:]
        free, totals = wait_all_free(client, ns)
        assert free == totals
