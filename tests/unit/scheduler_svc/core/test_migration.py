"""KV migration in the pure core (core/migration.py): a source scheduler lends a request's blocks
and requeues it; a destination scheduler claims it, plans a pull, and counts the KV once the pull
is reported. Two ``Scheduler`` objects stand in for two executors' loops; ``run_step`` plays the
executor (token 7 for every sampled row) and the pull results are given by hand, which isolates
the bookkeeping from any transfer."""

from __future__ import annotations

from scheduler_svc.core import migration
from scheduler_svc.core.blocks import CPU, DEVICE
from scheduler_svc.core.migration import KvSource
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.request import Request, Status
from scheduler_svc.core.scheduler import Scheduler
from tests.unit.scheduler_svc.core.test_scheduler import make, req, run_step


def source_of(executor: str = "A"):  # noqa: ANN201
    return lambda lid, blocks, tokens: KvSource(executor, "a:1", 5, lid, blocks, tokens, 1000)


def decoded(s: Scheduler, r: Request, steps: int) -> None:
    s.add(r)
    for _ in range(steps):
        run_step(s)


def handed_over(r: Request) -> Request:
    """What the destination's claim loads: the request as Redis holds it after the source's commit."""
    return Request(r.request_id, r.prompt_ids, r.params, output_ids=list(r.output_ids), kv=r.kv)


def test_a_lend_holds_the_blocks_a_migrated_request_leaves_with() -> None:
    a = make(blocks=16)
    r = req("r", prompt=10)
    decoded(a, r, 4)  # prompt in one step, then 3 decodes: 13 tokens computed, 4 blocks
    held = list(r.blocks)
    a.moves.migrate(r, source_of(), now_ms=1000)
    assert r.status == Status.WAITING and r.blocks == [] and r.num_computed == 0
    assert r.kv is not None and r.kv.tokens == 13 and r.kv.blocks == tuple((int(DEVICE), b) for b in held)
    assert a.blocks.num_free(DEVICE) == 16 - len(held), "lent blocks are not free"
    rec = a.take_record()
    assert [x.lend_id for x in rec.lent] == [r.kv.lend] and rec.requeued == [r]
    out = a.schedule()
    assert [x.lend_id for x in out.lends] == [r.kv.lend] and not out.scheduled, "the next plan registers it"
    assert a.moves.end_lend(r.kv.lend) and not a.moves.end_lend(r.kv.lend)
    assert a.blocks.num_free(DEVICE) == 16
    assert a.take_record().unlent == [r.kv.lend]
    assert a.schedule().unlends == [r.kv.lend]


def test_a_swapped_request_lends_its_swap_blocks() -> None:
    a = make(blocks=16, cpu=8, preemption_mode="swap")
    r = req("r", prompt=10)
    decoded(a, r, 2)
    moves = a.blocks.swap_out(r)
    a.blocks.release_pending(moves)
    a.running.remove(r)
    r.status = Status.SWAPPED
    a.swapped.add(r)
    a.moves.migrate(r, source_of(), now_ms=0)
    assert r.kv is not None and {t for t, _ in r.kv.blocks} == {int(CPU)}
    assert a.blocks.num_free(CPU) == 8 - len(r.kv.blocks)
    a.moves.end_lend(r.kv.lend)
    assert a.blocks.num_free(CPU) == 8 and a.blocks.num_free(DEVICE) == 16


def test_the_destination_pulls_then_decodes_from_where_the_source_stopped() -> None:
    a, b = make(blocks=16), make(blocks=16)
    r = req("r", prompt=10, max_tokens=20)
    decoded(a, r, 4)
    a.moves.migrate(r, source_of(), now_ms=1000)
    moved = handed_over(r)
    b.add(moved)
    out = b.schedule()
    assert not out.scheduled and len(out.pulls) == 1, "nothing runs while its KV is on its way"
    pull = out.pulls[0]
    assert pull.first == 0 and len(pull.dst) == 4 and pull.src_blocks == r.kv.blocks  # type: ignore[union-attr]
    assert moved.pulling and moved.num_computed == 0
    again = b.schedule()  # the pipelined loop's next plan, built before the pull's result
    assert not again.scheduled and not again.pulls
    b.update(out, {}, pulled={"r": (True, 3.0, 4096)})
    b.update(again, {})
    assert not moved.pulling and moved.num_computed == 13 and moved.kv is None
    nxt = run_step(b)
    assert [(s.start, s.num_tokens) for s in nxt.scheduled] == [(13, 1)], "only the last sampled token runs"
    rec = b.take_record()
    assert rec.stalls == [1000] and rec.counters.migrations_in == 1 and rec.counters.migrated_bytes == 4096
    assert [src.lend for _, src in rec.pulled] == [r.kv.lend]  # type: ignore[union-attr]


def test_a_failed_pull_recomputes_in_the_blocks_it_got() -> None:
    b = make(blocks=16)
    src = KvSource("A", "a:1", 5, "l", tuple((0, i) for i in range(4)), 13, 0)
    moved = Request("r", list(range(10, 20)), output_ids=[7, 7, 7, 7], kv=src)
    b.add(moved)
    out = b.schedule()
    b.update(out, {}, pulled={"r": (False, 1.0, 0)})
    assert moved.num_computed == 0 and not moved.pulling
    nxt = run_step(b)
    assert [(s.start, s.num_tokens) for s in nxt.scheduled] == [(0, 14)], "all of it, from the start"
    assert b.take_record().counters.migrations_failed == 1


def test_a_prefix_hit_on_the_destination_shortens_the_pull() -> None:
    b = make(blocks=16)
    b.blocks.caching = True
    first = req("warm", prompt=10, max_tokens=1)
    decoded(b, first, 2)  # caches its first two full blocks (8 tokens) and finishes
    src = KvSource("A", "a:1", 5, "l", tuple((0, i) for i in range(4)), 13, 0)
    moved = Request("r", list(range(10, 20)), output_ids=[7, 7, 7, 7], kv=src)
    b.add(moved)
    out = b.schedule()
    (pull,) = out.pulls
    assert pull.first == 2 and len(pull.dst) == 2 and pull.src_blocks == src.blocks[2:4]


def test_pick_moves_what_serving_peers_have_room_for() -> None:
    def view(e: str, free: int, serving: bool = True) -> PoolView:
        return PoolView(e, serving, 4, (64, 0, 0), (free, 0, 0), 0, 0, 4096, 8, 0, {})

    rs = [req(f"r{i}", prompt=10) for i in range(3)]  # 11 tokens with the next: 3 blocks each
    views = {"me": view("me", 64), "b": view("b", 7), "c": view("c", 40, serving=False)}
    assert [r for r, _ in migration.pick(rs, views, "me", 4)] == rs[:2]
