"""LoRA in the scheduler core: the adapter digest roots the prefix cache; --max-loras per step; placement."""

from __future__ import annotations

from dataclasses import replace

from pagedserve.lora import Adapter
from scheduler_svc.core import lora, prefix
from scheduler_svc.core.placement import lora_preference
from scheduler_svc.core.request import Request
from scheduler_svc.state import codec
from tests.unit.scheduler_svc.core.test_placement import cand, claims, pool
from tests.unit.scheduler_svc.core.test_scheduler import make, req, run_step

A = Adapter("a", "/a", "aa" * 32, 8)
A2 = Adapter("also-a", "/elsewhere", "aa" * 32, 8)  # another name for the same weights
B = Adapter("b", "/b", "bb" * 32, 8)
C = Adapter("c", "/c", "cc" * 32, 8)


def on(r: Request, adapter: Adapter | None) -> Request:
    r.lora = adapter
    return r


def test_the_adapter_digest_roots_the_hash_chain() -> None:
    tokens = list(range(16))
    base = prefix.prompt_hashes(tokens, None, 4)
    assert base == [h.hex() for h in prefix.extend([], tokens, None, 4, 3)], "the base model's hashes are unchanged"
    a = prefix.prompt_hashes(tokens, None, 4, A.digest)
    assert a == prefix.prompt_hashes(tokens, None, 4, A2.digest), "same weights, same blocks"
    assert not set(a) & set(base) and not set(a) & set(prefix.prompt_hashes(tokens, None, 4, B.digest))
    assert not set(a) & set(prefix.prompt_hashes(tokens, "s", 4, A.digest)), "the salt still applies"


def test_admits_counts_distinct_digests() -> None:
    running = [on(req("1", 4), A), on(req("2", 4), None)]
    assert lora.admits(running, on(req("3", 4), A2), 1), "same weights under another name: no new slot"
    assert not lora.admits(running, on(req("3", 4), B), 1)
    assert lora.admits(running, on(req("3", 4), B), 2)
    assert lora.admits(running, on(req("3", 4), None), 1), "the base model takes no slot"
    assert lora.admits(running, on(req("3", 4), C), 0), "0: no limit (LoRA off)"


def test_a_third_adapter_waits_at_the_head_and_runs_once_a_slot_frees() -> None:
    s = make(blocks=64, max_loras=2)
    for i, adapter in enumerate([A, B, C, None]):
        s.add(on(req(str(i), 4, max_tokens=3 if i == 0 else 6, arrival=i), adapter))
    first = run_step(s)
    assert [x.req.request_id for x in first.scheduled] == ["0", "1"], "C waits (FCFS): so does what is behind it"
    seen = set()
    for _ in range(10):
        out = run_step(s)
        digests = {x.req.lora.digest for x in out.scheduled if x.req.lora is not None}
        assert len(digests) <= 2, "never more adapters in a step than --max-loras"
        seen |= {x.req.request_id for x in out.scheduled}
    assert {"2", "3"} <= seen, "C's request starts once A's ends; nothing starves"


def test_placement_prefers_the_pool_running_the_adapter_then_a_free_slot() -> None:
    c = replace(cand(1), adapter=A.digest)
    holds = replace(pool("x", free=40, running=2), max_loras=2, adapters=(A.digest,))  # busier, runs A
    free_slot = replace(pool("y", free=48, running=2), max_loras=2, adapters=(B.digest,))
    full = replace(pool("z", free=64, running=2), max_loras=2, adapters=(B.digest, C.digest))  # idlest, no slot
    assert lora_preference(c, holds) > lora_preference(c, free_slot) > lora_preference(c, full) == 0.0
    assert claims([c], {"x": holds, "y": free_slot, "z": full})["x"] == ["r1"]
    assert claims([c], {"y": free_slot, "z": full})["y"] == ["r1"]
    base = cand(2)
    assert lora_preference(base, holds) == 0.0 and claims([base], {"x": holds, "z": full})["z"] == ["r2"]
    assert codec.view_from("x", codec.view_json(holds)) == holds, "the published view keeps the adapters"
    assert "loras" not in codec.view_json(pool("w")), "without LoRA the view is what it was"


def test_a_pool_without_a_slot_never_takes_the_adapter_however_idle() -> None:
    c = replace(cand(1), adapter=A.digest)
    busy = replace(pool("y", free=8, running=6), max_loras=1)  # a slot, and 7/8 of its blocks in use
    full = replace(pool("z", free=64, running=1), max_loras=1, adapters=(B.digest,))  # idle blocks, no slot
    assert claims([c], {"y": busy, "z": full}) == {"y": ["r1"], "z": []}, "it would wait behind B's requests on z"
    # No slot anywhere: it fits nowhere now and waits at the head of the queue, as a request too big for
    # every pool does; what is behind it waits too (FCFS: it runs as soon as a slot frees).
    other = replace(pool("y", free=64, running=1), max_loras=1, adapters=(C.digest,))
    assert claims([c, cand(2)], {"y": other, "z": full}) == {"y": [], "z": []}
    assert claims([c, cand(2)], {"y": replace(other, adapters=()), "z": full}) == {"y": ["r1"], "z": ["r2"]}


def test_one_look_counts_the_slots_it_gives_away() -> None:
    # y and z each have one free slot: two new adapters in one look go one to each, not both to the
    # least loaded (where the second would wait), and a second request on an adapter follows the first.
    y = replace(pool("y", free=60, running=1), max_loras=2, adapters=(B.digest,))
    z = replace(pool("z", free=50, running=1), max_loras=2, adapters=(B.digest,))
    on_a, on_c, again_a = (replace(cand(i), adapter=d) for i, d in ((1, A.digest), (2, C.digest), (3, A.digest)))
    got = claims([on_a, on_c, again_a], {"y": y, "z": z})
    assert got == {"y": ["r1", "r3"], "z": ["r2"]}, got


def test_an_idle_adapter_in_a_device_slot_draws_its_requests() -> None:
    c = replace(cand(1), adapter=A.digest)
    loaded = replace(pool("y", free=62, running=0), max_loras=2, loaded=(A.digest, B.digest))  # a bit busier
    cold = replace(pool("x", free=64, running=0), max_loras=2, loaded=(C.digest,))
    assert lora_preference(c, loaded) > lora_preference(c, cold) > 0
    assert claims([c], {"x": cold, "y": loaded}) == {"x": [], "y": ["r1"]}
    full = replace(loaded, adapters=(B.digest, C.digest))  # it holds A, but both slots run others' requests
    assert lora_preference(c, full) == 0.0 and claims([c], {"x": cold, "y": full}) == {"x": ["r1"], "y": []}
    assert codec.view_from("y", codec.view_json(loaded)) == loaded, "the published view keeps the slots"
