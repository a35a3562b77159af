"""KV that moves ahead of a request, in the pure core: pre-copy (core/migration.py ``Scheduler.precopy``),
fetches (core/prefetch.py), peer prefix hits (``ask``/``answer``), the cost model (core/costs.py) and the
rebalance policy (core/rebalance.py). Two ``Scheduler`` objects stand in for two executors' loops;
``run_step`` plays the executor (token 7 for every sampled row) and pull results are given by hand, which
isolates the bookkeeping from any transfer; every test ends with each pool's blocks accounted for."""

from __future__ import annotations

from collections import Counter

from scheduler_svc.core import rebalance
from scheduler_svc.core.blocks import DEVICE
from scheduler_svc.core.costs import Costs
from scheduler_svc.core.migration import Ask, KvSource, Offer
from scheduler_svc.core.placement import PoolView
from scheduler_svc.core.prefetch import FETCH_TTL_MS
from scheduler_svc.core.request import Finish, Request, Status
from scheduler_svc.core.scheduler import ASK_TIMEOUT_MS, Scheduler
from tests.unit.scheduler_svc.core.test_migration import handed_over, source_of
from tests.unit.scheduler_svc.core.test_scheduler import make, req, run_step


def cached(**kw: object) -> Scheduler:
    s = make(**kw)  # type: ignore[arg-type]
    s.blocks.caching = s.blocks._track = True
    return s


def holders(s: Scheduler) -> Counter[int]:
    """Device block -> holders the scheduler knows of: requests, lends, fetches."""
    n: Counter[int] = Counter()
    for r in s.requests.values():
        n.update(r.blocks)
    for lent in s.moves.lending.lends.values():
        n.update(b for t, b in lent.blocks if t == DEVICE)
    for f in s.moves.fetches.by_request.values():
        n.update(f.blocks)
    return n


def accounted(s: Scheduler) -> None:
    """Every device block is held exactly as often as its reference count says, or free; none both."""
    bm, held = s.blocks, holders(s)
    for b in range(bm.total(DEVICE)):
        assert bm.refs[b] == held[b], f"block {b}: {bm.refs[b]} references, {held[b]} holders"
        assert bm.is_free(DEVICE, b) == (held[b] == 0), f"block {b}: free flag and holders disagree"
    assert len(held) + bm.num_free(DEVICE) == bm.total(DEVICE)


def decoded(s: Scheduler, r: Request, steps: int) -> None:
    s.add(r)
    for _ in range(steps):
        run_step(s)


def test_a_precopy_lends_the_full_blocks_while_the_request_keeps_decoding() -> None:
    a = cached(blocks=32)
    r = req("r", prompt=10, max_tokens=40)
    decoded(a, r, 4)  # 13 tokens computed: 3 full blocks named
    assert a.moves.precopy(r, "B", source_of(), 1000, "drain")
    assert not a.moves.precopy(r, "B", source_of(), 1001, "drain"), "one pre-copy at a time"
    (lent,) = a.moves.lending.lends.values()
    assert [b for _, b in lent.blocks] == r.blocks[:3] and r.status == Status.RUNNING
    assert not a.take_record().offers, "the offer waits for the plan that registers its lend"
    out = run_step(a)
    assert [x.lend_id for x in out.lends] == [lent.lend_id] and out.scheduled, "it decodes in the same plan"
    (offer,) = a.take_record().offers
    assert offer.to == "B" and offer.src.cause == "drain" and offer.src.tokens == 12 and len(offer.hashes) == 3
    accounted(a)
    run_step(a)
    assert a.moves.lending.moving("r") and "r" not in a.moves.lending.copied
    assert a.moves.end_lend(lent.lend_id)
    assert "r" in a.moves.lending.copied, "its pre-copy is done: the short stop comes next"
    accounted(a)
    a.moves.lending.forget("r")
    a.moves.migrate(r, source_of(), 2000, "drain", to="B")
    assert r.kv is not None and r.kv.to == "B" and r.kv.cause == "drain" and r.kv.tokens == 15
    accounted(a)


def test_the_destination_fetches_the_precopy_and_pulls_only_the_rest() -> None:
    a, b = cached(blocks=32), cached(blocks=32)
    r = req("r", prompt=10, max_tokens=40)
    decoded(a, r, 4)
    a.moves.precopy(r, "B", source_of(), 1000, "drain")
    run_step(a)
    (offer,) = a.take_record().offers
    assert b.moves.fetch(offer, 1000)
    out = b.schedule()
    (pull,) = out.pulls
    assert pull.req is None and pull.key == "fetch/r/0" and len(pull.dst) == 3 and pull.src_blocks == offer.src.blocks
    accounted(b)
    b.update(out, {}, pulled={"fetch/r/0": (True, 2.0, 3000)})
    rec = b.take_record()
    assert rec.rung == [offer.src.lend] and rec.counters.precopy_blocks == 3 and len(rec.cache.added) == 3
    a.moves.end_lend(offer.src.lend)
    run_step(a)  # the request decodes on while the fetch runs: 15 tokens computed
    a.moves.lending.forget("r")
    a.moves.migrate(r, source_of(), 2000, "drain", to="B")
    moved = handed_over(r)
    b.add(moved)
    out = b.schedule()
    (tail,) = out.pulls
    assert tail.req is moved and tail.first == 3 and len(tail.dst) == 1, "only the block after the pre-copy"
    assert "r" not in b.moves.fetches, "admitted: its prefix hit holds what the fetch held"
    b.update(out, {}, pulled={"r": (True, 1.0, 1000)})
    assert moved.num_computed == 15
    accounted(b)
    a.moves.end_lend(r.kv.lend)  # type: ignore[union-attr]
    accounted(a)
    assert a.blocks.num_free(DEVICE) == 32


def test_a_failed_fetch_frees_its_blocks_and_ends_the_lend() -> None:
    b = cached(blocks=16)
    src = KvSource("A", "a:1", 5, "l@1/pre", tuple((0, i) for i in range(3)), 12, 0, "precopy", "B")
    assert b.moves.fetch(Offer("B", "r", src, ("aa" * 32, "bb" * 32, "cc" * 32)), 0)
    out = b.schedule()
    b.update(out, {}, pulled={})  # no report for it: failed
    rec = b.take_record()
    assert rec.rung == ["l@1/pre"] and rec.counters.fetches_failed == 1 and "fetch/r" in rec.unlent
    assert b.blocks.num_free(DEVICE) == 16 and not b.moves.fetches
    accounted(b)


def test_an_unused_fetch_lets_its_blocks_go_after_its_ttl_but_never_mid_pull() -> None:
    b = cached(blocks=16)
    src = KvSource("A", "a:1", 5, "l", tuple((0, i) for i in range(2)), 8, 0, "precopy", "B")
    b.moves.fetch(Offer("B", "r", src, ("aa" * 32, "bb" * 32)), 0)
    out = b.schedule()
    b.moves.expire(FETCH_TTL_MS * 2)
    assert "r" in b.moves.fetches, "its pull is in flight: its blocks may still be written"
    b.update(out, {}, pulled={"fetch/r/0": (True, 1.0, 100)})
    assert b.blocks.num_free(DEVICE) == 14 and b.blocks.num_evictable() == 0, "named, and held by the fetch"
    b.moves.expire(FETCH_TTL_MS * 2)
    assert "r" not in b.moves.fetches and b.blocks.num_evictable() == 2, "named, nobody's: evictable"
    accounted(b)


def test_a_peer_prefix_hit_asks_the_holder_and_computes_only_the_rest() -> None:
    h, p = cached(blocks=32), cached(blocks=32)
    warm = req("warm", prompt=33, max_tokens=1)
    decoded(h, warm, 2)  # h caches 8 full blocks of the 33-token prompt
    assert not h.requests
    x = req("x", prompt=33, max_tokens=4)
    p.add(x)
    ask = p.moves.ask(x, {"H": 8}, "P", now_ms=100)
    assert ask is not None and ask.to == "H" and ask.start == 0 and len(ask.hashes) == 8
    assert "x" in p.moves.asking and not list(p.waiting) and not p.schedule().scheduled, "it waits for the offer"
    assert p.take_record().asks == [ask]
    h.moves.answer(ask, source_of("H"), now_ms=150)
    assert h.blocks.num_evictable() == 0, "lent cached blocks are held: the cache cannot evict them"
    run_step(h)
    (offer,) = h.take_record().offers
    assert offer.src.cause == "prefix" and offer.src.tokens == 32 and offer.hashes == ask.hashes
    p.moves.fetch(offer, now_ms=400)
    assert p.moves.costs.ask_ms.value == 300
    out = p.schedule()
    p.update(out, {}, pulled={"fetch/x/0": (True, 8.0, 9000)})
    assert list(p.waiting) == [x], "its wait is over"
    out = run_step(p)
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(32, 1)], "only the last prompt token runs"
    assert p.take_record().counters.prefix_blocks == 8
    h.moves.end_lend(offer.src.lend)
    accounted(h)
    accounted(p)


def test_a_holder_that_caches_nothing_any_more_says_so_at_once() -> None:
    h, p = cached(blocks=16), cached(blocks=16)
    x = req("x", prompt=20, max_tokens=2)
    p.add(x)
    ask = p.moves.ask(x, {"H": 4}, "P", 0)
    assert ask is not None
    h.moves.answer(ask, source_of("H"), 10)
    (offer,) = h.take_record().offers
    assert offer.src.blocks == () and not h.moves.lending.lends
    assert not p.moves.fetch(offer, 20)
    assert list(p.waiting) == [x] and p.take_record().rung == [], "nothing lent: nothing to end"


def test_an_unanswered_ask_times_out_and_the_request_computes() -> None:
    p = cached(blocks=16)
    x = req("x", prompt=20, max_tokens=2)
    p.add(x)
    assert p.moves.ask(x, {"H": 4}, "P", 0) is not None
    p.moves.expire(ASK_TIMEOUT_MS - 1)
    assert "x" in p.moves.asking
    p.moves.expire(ASK_TIMEOUT_MS)
    assert list(p.waiting) == [x] and p.take_record().counters.peer_prefix_timeouts == 1
    out = run_step(p)
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(0, 20)]


def test_a_cancelled_asking_request_leaves_cleanly() -> None:
    p = cached(blocks=16)
    x = req("x", prompt=20, max_tokens=2)
    p.add(x)
    p.moves.ask(x, {"H": 4}, "P", 0)
    p.finish("x", Finish.ABORT)
    assert not p.moves.asking and not p.requests


def test_no_ask_when_the_measured_pull_costs_more_than_the_prefill() -> None:
    p = cached(blocks=64)
    for tokens in (16, 64, 256, 32, 128):
        p.moves.costs.stepped(tokens, 1.0 + 0.01 * tokens)  # 0.01 ms a token
    p.moves.costs.pulled(4, 40.0)  # 10 ms a block: 0.625 ms a token at 16 tokens a block... of 4 here
    x = req("x", prompt=40, max_tokens=2)
    p.add(x)
    assert p.moves.ask(x, {"H": 9}, "P", 0) is None and list(p.waiting) == [x]
    cheap = cached(blocks=64)
    for tokens in (16, 64, 256, 32, 128):
        cheap.moves.costs.stepped(tokens, 1.0 + 0.5 * tokens)  # 0.5 ms a token
    cheap.moves.costs.pulled(4, 0.4)
    y = req("y", prompt=40, max_tokens=2)
    cheap.add(y)
    assert cheap.moves.ask(y, {"H": 9, "P": 2}, "P", 0) is not None


def test_the_cost_model_fits_the_marginal_cost_of_a_token() -> None:
    c = Costs.fresh()
    assert c.pull_pays(3, 16), "nothing measured yet: try the pull"
    for tokens in (8, 300, 40, 1000, 120, 600):
        c.stepped(tokens, 20.0 + 0.25 * tokens)  # a fixed 20 ms a step, 0.25 ms a token
    slope = c.prefill.slope()
    assert slope is not None and abs(slope - 0.25) < 1e-9
    c.pulled(10, 30.0)
    c.answered(50.0)
    assert c.move_ms(4) == 50.0 + 3.0 * 4
    assert c.pull_pays(4, 16) == (62.0 < 0.25 * 64)
    flat = Costs.fresh()
    for _ in range(5):
        flat.stepped(32, 16.0)  # no spread in step sizes: the mean per token
    assert flat.prefill.slope() == 0.5


def _view(e: str, total: int, free: int, running: int = 0, serving: bool = True) -> PoolView:
    return PoolView(e, serving, 4, (total, 0, 0), (free, 0, 0), running, 0, 4096, 64, 0, {})


def _running(n: int, tokens: int) -> list[Request]:
    out = []
    for i in range(n):
        r = req(f"r{i}", prompt=tokens, max_tokens=200)
        r.num_computed = tokens
        r.blocks = list(range(i * 10, i * 10 + (tokens + 3) // 4))
        r.status = Status.RUNNING
        out.append(r)
    return out


def test_rebalance_moves_the_first_victims_before_a_preemption() -> None:
    rs = _running(6, 20)  # 5 blocks each
    mine = _view("me", 40, 2, running=6)  # 2 free for 6 running: a shortfall of 4 blocks
    views = {"me": mine, "b": _view("b", 40, 30), "c": _view("c", 40, 10, serving=False)}
    moves = rebalance.pick(rs[::-1], mine, views, gap=0.9, block_size=4)
    assert [(m.req.request_id, m.to, m.cause) for m in moves] == [("r5", "b", "preempt")]


def test_rebalance_closes_a_usage_gap_by_half_and_never_flips_it() -> None:
    rs = _running(8, 20)
    mine = _view("me", 100, 60, running=8)  # 40% used
    views = {"me": mine, "b": _view("b", 100, 100), "c": _view("c", 100, 95)}
    moves = rebalance.pick(rs[::-1], mine, views, gap=0.3, block_size=4)
    assert [m.req.request_id for m in moves] == ["r7", "r6", "r5"] and {m.cause for m in moves} == {"rebalance"}
    assert [m.to for m in moves] == ["b", "c", "b"], "each to the least loaded peer at the time"
    used = {"me": 40 - 5 * len(moves), "b": 12, "c": 5 + 6}  # each move: its 5 blocks, and 6 where it lands
    assert 0 <= used["me"] / 100 - min(used["b"], used["c"]) / 100 <= 0.3 / 2, "half the gap is left, not flipped"
    assert rebalance.pick(rs[::-1], mine, views, gap=0.5, block_size=4) == [], "under the gap: nothing moves"


def test_rebalance_leaves_requests_not_worth_moving() -> None:
    rs = _running(3, 20)
    rs[0].params = rs[0].params.__class__(max_tokens=2)  # about to finish
    rs[1].group = "g"  # a parallel-sampling group: its mates share blocks
    rs[2].num_computed, rs[2].blocks = 2, [0]  # not a block of KV yet
    mine = _view("me", 40, 0, running=3)
    views = {"me": mine, "b": _view("b", 40, 40)}
    assert rebalance.pick(rs[::-1], mine, views, gap=0.1, block_size=4) == []


def test_the_offer_and_ask_doorbells_round_trip_through_the_codec() -> None:
    from scheduler_svc.state import codec

    src = KvSource("A", "a:1", 5, "l@1/pre", ((0, 3), (1, 4)), 8, 12, "precopy", "B")
    offer = Offer("B", "r", src, ("aa" * 32, "bb" * 32), 2)
    assert codec.offer_from("B", "r", codec.offer_json(offer)) == offer
    ask = Ask("H", "x", "P", ("cc" * 32,), 3)
    assert codec.ask_from("H", "x", codec.ask_json(ask)) == ask
    assert codec.kv_from(codec.kv_json(src)) == src
