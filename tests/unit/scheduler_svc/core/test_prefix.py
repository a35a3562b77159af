"""Automatic prefix caching on plain data: hashes, reference counts, LRU eviction, sharing under preemption."""

from __future__ import annotations

from scheduler_svc.core import prefix
from scheduler_svc.core.blocks import CPU, DEVICE, BlockManager, Pool
from scheduler_svc.core.request import Params, Request, Status
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(total: int = 12, cpu: int = 0, mode: str = "recompute", caching: bool = True) -> Scheduler:
    bm = BlockManager(BS, Pool.fresh(total), Pool.fresh(cpu), caching=caching)
    return Scheduler(SchedulerConfig(max_model_len=128, preemption_mode=mode, watermark=0.0), bm)


def req(rid: str, prompt: list[int], max_tokens: int = 2, salt: str | None = None) -> Request:
    return Request(rid, prompt, Params(max_tokens=max_tokens, temperature=0.0), cache_salt=salt)


def run(s: Scheduler, token: int = 7) -> None:
    """Step until nothing is left (every sampled token is ``token``, never EOS)."""
    while s.has_work:
        out = s.schedule()
        s.update(out, {x.req.request_id: token for x in out.scheduled if x.samples})


def first_step(s: Scheduler, r: Request) -> tuple[int, int]:
    """Admit ``r`` and return (start, tokens) of its first scheduled chunk."""
    s.add(r)
    out = s.schedule()
    (x,) = [x for x in out.scheduled if x.req is r]
    s.update(out, {r.request_id: 7} if x.samples else {})
    return x.start, x.num_tokens


def test_hashes_chain_over_the_prefix_and_the_salt() -> None:
    a = prefix.extend([], list(range(12)), None, BS, 3)
    b = prefix.extend([], list(range(8)) + [99, 9, 10, 11], None, BS, 3)
    assert a[:2] == b[:2] and a[2] != b[2]
    c = prefix.extend([], [0, 1, 2, 99] + list(range(4, 12)), None, BS, 3)
    assert all(x != y for x, y in zip(a, c)), "a change early changes every later block's hash"
    assert (
        prefix.extend([], list(range(12)), "t1", BS, 3)[0] != a[0] != prefix.extend([], list(range(12)), "t2", BS, 1)[0]
    )
    assert prefix.root("") == prefix.root(None)
    assert len(prefix.prompt_hashes(list(range(8)), None, BS)) == 1, "a whole-prompt hit would leave nothing to compute"
    assert len(prefix.prompt_hashes(list(range(9)), None, BS)) == 2


def test_a_shared_prefix_is_computed_once_and_its_blocks_are_shared() -> None:
    s = make()
    run_first = req("a", list(range(10)))  # 2 full blocks + 2 tokens
    s.add(run_first)
    run(s)
    assert s.blocks.num_evictable() == 2 and s.blocks.num_free() == 12
    b = req("b", list(range(10)) + [50, 51])
    assert first_step(s, b) == (8, 4), "b starts after the 8 cached tokens"
    assert b.num_cached == 8 and s.counters.prefix_cache_hits == 8
    c = req("c", list(range(8)) + [60])
    assert first_step(s, c) == (8, 1)
    assert c.blocks[:2] == b.blocks[:2] and s.blocks.refs[b.blocks[0]] == 2
    assert s.blocks.used() == 4 + 1, "b: 2 shared + 2 own (it decodes into a 4th); c: 1 own"
    assert s.counters.prefix_cache_queries == 10 + 12 + 9


def test_a_whole_prompt_hit_still_computes_its_last_token() -> None:
    s = make()
    s.add(req("a", list(range(8))))
    run(s)
    b = req("b", list(range(8)))
    assert first_step(s, b) == (4, 4), "only the first block hits: the last token needs logits"


def test_different_salts_share_nothing() -> None:
    s = make()
    s.add(req("a", list(range(12)), salt="tenant-a"))
    run(s)
    assert first_step(s, req("b", list(range(12)), salt="tenant-b")) == (0, 12)
    assert first_step(s, req("c", list(range(12)))) == (0, 12)
    assert first_step(s, req("d", list(range(12)), salt="tenant-a")) == (8, 4)


def test_caching_off_hashes_nothing() -> None:
    s = make(caching=False)
    s.add(req("a", list(range(12))))
    run(s)
    assert first_step(s, req("b", list(range(12)))) == (0, 12)
    assert not s.blocks.hash_of and s.counters.prefix_cache_queries == 0


def test_eviction_takes_plain_free_blocks_first_then_the_least_recently_freed_tail_first() -> None:
    s = make(total=6)
    a = req("a", list(range(9)), max_tokens=1)  # blocks 0..2; 2 full blocks cached
    s.add(a)
    run(s)
    held = list(s.blocks.lru)
    assert len(held) == 2 and held[0] != held[1]
    tail, head = held  # freed last to first: the tail block is evicted first
    b = req("b", [90 + i for i in range(17)], max_tokens=1)  # 5 blocks: 4 plain free + 1 eviction
    s.add(b)
    s.schedule()
    assert tail not in s.blocks.hash_of and head in s.blocks.hash_of


def test_cached_blocks_are_reclaimed_before_anyone_is_preempted() -> None:
    s = make(total=6)
    s.add(req("a", list(range(16)), max_tokens=1))
    run(s)
    assert s.blocks.num_evictable() == 4
    s.add(req("b", [50 + i for i in range(20)], max_tokens=4))  # 5 blocks, then a 6th while decoding
    run(s)
    assert s.counters.preemptions_recompute == 0 and s.counters.preemptions_swap == 0


def test_recompute_preemption_drops_references_and_shared_blocks_stay() -> None:
    s = make(total=7)
    s.add(req("a", list(range(9)), max_tokens=1))
    run(s)
    b, c = req("b", list(range(9)), max_tokens=16), req("c", list(range(9)) + [5], max_tokens=16)
    s.add(b)
    s.add(c)
    out = s.schedule()
    s.update(out, {x.req.request_id: 7 for x in out.scheduled if x.samples})
    shared = b.blocks[:2]
    assert c.blocks[:2] == shared and all(s.blocks.refs[x] == 2 for x in shared)
    run(s)  # they grow until one preempts the other
    assert s.counters.preemptions_recompute > 0
    assert s.blocks.num_free() == 7 and all(s.blocks.refs[x] == 0 for x in range(7))


def test_swap_out_copies_everything_frees_only_what_the_victim_held_alone() -> None:
    s = make(total=8, cpu=8, mode="swap")
    s.add(req("a", list(range(9)), max_tokens=1))
    run(s)
    b = req("b", list(range(9)), max_tokens=20)
    s.add(b)
    out = s.schedule()
    s.update(out, {"b": 7})
    c = req("c", list(range(9)) + [1], max_tokens=20)
    s.add(c)
    out = s.schedule()
    s.update(out, {x.req.request_id: 7 for x in out.scheduled if x.samples})
    shared, own = c.blocks[:2], c.blocks[2:]
    victim_moves = s.blocks.swap_out(c)
    s.running.remove(c)
    c.status = Status.SWAPPED
    assert [m.src for m in victim_moves] == shared + own, "the victim's whole KV is copied"
    assert all(m.dst_tier == CPU for m in victim_moves)
    assert all(s.blocks.refs[x] == 1 for x in shared), "b still holds the shared blocks"
    assert all(not s.blocks.is_free(DEVICE, x) for x in own), "sources stay pending until the copy is done"
    s.blocks.release_pending()
    assert all(s.blocks.is_free(DEVICE, x) for x in own)
    moves = s.blocks.swap_in(c)
    assert len(moves) == len(victim_moves) and set(c.blocks).isdisjoint(shared)


def test_a_hit_on_a_pending_swap_source_keeps_it() -> None:
    bm = BlockManager(BS, Pool.fresh(6), Pool.fresh(4), caching=True)
    a = req("a", list(range(9)), max_tokens=5)
    bm.allocate(a, [], 9)
    a.num_computed = 9
    bm.cache(a)
    bm.swap_out(a)
    b = req("b", list(range(9)))
    hit = bm.lookup(b)
    assert len(hit) == 2
    bm.allocate(b, hit, 1)
    bm.release_pending()
    assert all(bm.refs[x] == 1 and not bm.is_free(DEVICE, x) for x in hit)
    bm.free(b)
    assert bm.num_free() == 6 and bm.num_evictable() == 2


def test_cache_delta_says_what_the_commit_writes() -> None:
    bm = BlockManager(BS, Pool.fresh(4), caching=True)
    a = req("a", list(range(9)))
    bm.allocate(a, [], 9)
    a.num_computed = 9
    bm.cache(a)
    d = bm.cache_delta(bm.take_changes()[DEVICE])
    assert sorted(d.hashed) == a.blocks[:2] and len(d.added) == 2 and not d.evictable
    blocks = list(a.blocks)
    bm.free(a)
    d = bm.cache_delta(bm.take_changes()[DEVICE])
    assert sorted(d.evictable) == blocks[:2] and d.held == [blocks[2]] and d.unhashed == [blocks[2]]
    b = req("b", [50 + i for i in range(16)])
    bm.allocate(b, [], 16)  # every block: the cached ones are evicted
    d = bm.cache_delta(bm.take_changes()[DEVICE])
    assert len(d.dropped) == 2 and not d.added and sorted(d.held) == sorted(b.blocks)
