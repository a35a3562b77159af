"""LoRA in the scheduler core: the adapter digest roots the prefix cache; --max-loras per step."""

from __future__ import annotations

from pagedserve.lora import Adapter
from scheduler_svc.core import lora, prefix
from scheduler_svc.core.request import Request
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
    from dataclasses import replace

    from scheduler_svc.core.placement import lora_preference
    from scheduler_svc.state import codec
    from tests.unit.scheduler_svc.core.test_placement import cand, claims, pool

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
