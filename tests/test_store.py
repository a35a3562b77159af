"""The store's Lua scripts on a real redis-server, checked against the pure codec they
must agree with: queue entries, the events they emit, atomic claims, reaping, fencing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from scheduler_svc.core.request import Finish, Params, Request
from scheduler_svc.state import codec
from scheduler_svc.state.store import Fenced, RedisStore, Stale


@pytest.fixture()
def store(redis_url: str, request: pytest.FixtureRequest) -> Iterator[RedisStore]:
    """A store on a namespace of its own."""
    loop = asyncio.new_event_loop()
    client = aioredis.from_url(redis_url, decode_responses=True)
    s = RedisStore(client, f"store-{request.node.name}")
    s.run = loop.run_until_complete  # type: ignore[attr-defined]
    yield s
    loop.run_until_complete(client.aclose())
    loop.close()


def submit(store: RedisStore, rid: str, priority: int = 0, policy: str = "fcfs") -> int:
    req = Request(rid, [5, 6, 7], Params(max_tokens=4), priority=priority)
    return store.run(store.submit(req, [], policy))  # type: ignore[attr-defined]


def test_queue_entries_follow_the_codec_and_the_policy(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    a = submit(store, "a", priority=5, policy="priority")
    b = submit(store, "b", priority=1, policy="priority")
    queue = run(store.r.zrange(store.keys.queue, 0, -1, withscores=True))
    assert queue == [
        (codec.queue_entry(b, "b", 1, "priority")[1], 1.0),
        (codec.queue_entry(a, "a", 5, "priority")[1], 5.0),
    ], "priority order, as the codec writes it"
    candidates, _ = run(store.look(8))
    assert [(c.request_id, c.prompt_len, c.max_tokens, c.priority) for c in candidates] == [
        ("b", 3, 4, 1),
        ("a", 3, 4, 5),
    ]


def test_cancelling_a_queued_request_emits_the_codecs_event(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    submit(store, "q")
    assert run(store.cancel("q", Finish.ABORT))
    assert not run(store.cancel("q", Finish.ABORT)), "it is no longer live"
    ((_, event),) = run(store.read_events("0-0", block_ms=0))
    assert event == codec.Event(finished={"q": ("abort", 0)})
    assert run(store.r.zcard(store.keys.queue)) == 0 and run(store.r.scard(store.keys.live)) == 0


def test_a_request_is_claimed_by_one_executor_only(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    arrival = submit(store, "r")
    key = codec.queue_entry(arrival, "r", 0, "fcfs")[1]
    ea, eb = run(store.acquire("ea", "x", 60_000)), run(store.acquire("eb", "y", 60_000))
    got_a = run(store.claim("ea", ea, 0, [key]))
    got_b = run(store.claim("eb", eb, 0, [key]))
    assert [c.req.request_id for c in got_a] == ["r"] and got_b == []
    assert run(store.r.smembers(store.keys.executor("ea").live)) == {"r"}
    assert run(store.r.hget(store.keys.req("r"), "executor")) == "ea"


def test_a_stale_epoch_can_neither_claim_nor_commit(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    arrival = submit(store, "r")
    old = run(store.acquire("e", "x", 60_000))
    run(store.r.delete(store.keys.executor("e").leader))
    new = run(store.acquire("e", "y", 60_000))
    assert new > old
    with pytest.raises(Fenced):
        run(store.claim("e", old, 0, [codec.queue_entry(arrival, "r", 0, "fcfs")[1]]))
    with pytest.raises(Fenced):
        run(store.apply("e", old, 0, [["SET", "x", "1"]]))
    assert run(store.r.zcard(store.keys.queue)) == 1


def test_writes_count_and_a_write_on_lost_state_is_refused(store: RedisStore) -> None:
    """As after a restart from an AOF that missed the last writes: the sequence went back."""
    run = store.run  # type: ignore[attr-defined]
    epoch = run(store.acquire("e", "x", 60_000))
    assert run(store.apply("e", epoch, 0, [])) == 1
    assert run(store.apply("e", epoch, 1, [])) == 2
    run(store.r.set(store.keys.executor("e").seq, 1))  # the second write was lost
    with pytest.raises(Stale):
        run(store.apply("e", epoch, 2, [["SET", "x", "1"]]))
    assert run(store.r.get("x")) is None
    assert run(store.load("e")).seq == 1


def test_reaping_requeues_at_the_same_place_finishes_cancelled_and_fences(store: RedisStore) -> None:
    run = store.run  # type: ignore[attr-defined]
    keys = [codec.queue_entry(submit(store, rid), rid, 0, "fcfs")[1] for rid in ("r0", "r1")]
    epoch = run(store.acquire("e", "x", 60_000))
    run(store.claim("e", epoch, 0, keys))
    run(store.cancel("r1", Finish.STOP))  # placed: flagged for its loop
    assert run(store.reap("e")) == 1
    assert run(store.r.zrange(store.keys.queue, 0, -1)) == [keys[0]], "r0 is back where it was"
    assert run(store.r.hget(store.keys.req("r1"), "status")) == "finished"
    assert not any(run(store.r.exists(k)) for k in store.keys.executor("e").all())
    with pytest.raises(Fenced):
        run(store.apply("e", epoch, 1, [["SET", "x", "1"]]))
    assert run(store.acquire("e", "z", 60_000)) is None, "a reaped executor is never led again"
