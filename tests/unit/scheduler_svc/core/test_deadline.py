"""Queue deadlines on plain data: which requests expire, and what expiring frees."""

from __future__ import annotations

from scheduler_svc.core.blocks import CPU, DEVICE, DISK, BlockManager, Pool
from scheduler_svc.core.deadline import deadline_ms, expired, expired_among
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig


def req(rid: str, deadline: int, status: Status = Status.WAITING, output: int = 0, prompt: int = 8) -> Request:
    return Request(
        rid,
        list(range(10, 10 + prompt)),
        Params(max_tokens=16),
        output_ids=[7] * output,
        status=status,
        deadline_ms=deadline,
    )


def test_only_requests_that_have_not_started_expire() -> None:
    now = 10_000
    assert expired(req("queued", now), now), "at the deadline it has expired"
    assert expired(req("late", now - 1), now)
    assert not expired(req("early", now + 1), now)
    assert not expired(req("none", 0), now), "0 means no deadline"
    assert not expired(req("running", now - 1, Status.RUNNING), now), "a running request is never cut"
    assert not expired(req("streamed", now - 1, output=1), now), "nor one whose client saw a token"
    assert not expired(req("streamed-swapped", now - 1, Status.SWAPPED, output=3), now)
    assert expired(req("swapped-in-prefill", now - 1, Status.SWAPPED), now)
    assert not expired(req("done", now - 1, Status.FINISHED), now)
    reqs = [req("a", now - 5), req("b", now + 5), req("c", now - 5, Status.RUNNING)]
    assert [r.request_id for r in expired_among(reqs, now)] == ["a"]


def test_deadline_is_the_earlier_of_queue_timeout_and_the_call_deadline() -> None:
    assert deadline_ms(1000, None, None) == 0
    assert deadline_ms(1000, 2.0, None) == 3000
    assert deadline_ms(1000, None, 0.5) == 1500
    assert deadline_ms(1000, 2.0, 0.5) == 1500
    assert deadline_ms(1000, 0.25, 9.0) == 1250
    assert deadline_ms(1000, 1e-9, None) == 1001, "never the submission instant itself"
    assert deadline_ms(1000, 0.0015, None) == 1002, "rounded up: never before the time asked for"
    assert deadline_ms(0, 1e12, None) == deadline_ms(0, 1e300, None) == deadline_ms(0, 1e308, 1e308) > 0
    assert deadline_ms(1000, None, -0.5) == 1001, "a call already past its deadline expires at once"


def make() -> Scheduler:
    config = SchedulerConfig(max_model_len=4096, watermark=0.0, max_num_seqs=1)
    return Scheduler(config, BlockManager(4, Pool.fresh(8), Pool.with_free(4, [2, 3]), Pool.with_free(4, [1, 2, 3])))


def test_expiring_frees_swapped_blocks_and_records_the_finish() -> None:
    s = make()
    swapped = req("swapped", 100, Status.SWAPPED)
    swapped.swap_blocks, swapped.num_computed = [(CPU, 0), (CPU, 1), (DISK, 0)], 8
    s.add(swapped)
    s.add(req("waiting", 100))
    s.add(req("later", 10_000))
    gone = s.expire(5_000)
    assert sorted(r.request_id for r in gone) == ["swapped", "waiting"]
    assert all(r.status == Status.FINISHED and r.finish_reason == Finish.DEADLINE for r in gone)
    assert [s.blocks.num_free(t) for t in (DEVICE, CPU, DISK)] == [8, 4, 4], "every tier whole again"
    assert swapped.swap_blocks == []
    rec = s.take_record()
    assert sorted(r.request_id for r in rec.finished) == ["swapped", "waiting"]
    assert rec.counters.finished == 2
    assert {0, 1} <= rec.changed[CPU] and 0 in rec.changed[DISK], "the commit writes the freed blocks"
    assert list(s.requests) == ["later"]


def test_a_running_request_outlives_its_deadline() -> None:
    s = make()
    s.add(req("a", 100))
    s.add(req("b", 100))
    out = s.schedule()  # max_num_seqs 1: a runs, b stays waiting
    assert [x.req.request_id for x in out.scheduled] == ["a"]
    s.update(out, {})
    assert [r.request_id for r in s.expire(5_000)] == ["b"]
    assert s.requests["a"].status == Status.RUNNING
    s.requeue_waiting()
    assert s.take_record().requeued == [], "an expired request never goes back to the queue"
