"""Step plans carry block-table diffs; the executor's copy stays equal to the scheduler's."""

from __future__ import annotations

import pytest

from executor_svc.block_tables import BlockTables, UnknownTable
from scheduler_svc.loops.plan import PlanBuilder
from tests.unit.scheduler_svc.core.test_scheduler import make, req


def test_executor_tables_follow_the_scheduler_through_diffs_and_preemptions() -> None:
    s = make(blocks=6, preemption_mode="recompute", max_num_batched_tokens=6)
    s.add(req("a", 8, max_tokens=12, arrival=0))
    s.add(req("b", 8, max_tokens=12, arrival=1))
    plans, tables = PlanBuilder(), BlockTables(6)
    ended: list[str] = []
    first = True
    saw_diff = saw_forget = False
    while s.has_work:
        out = s.schedule()
        plan = plans.build(out, 0, ended)
        assert plan.reset_tables == first
        first = False
        for rid in plan.forget:
            tables.forget(rid)
        saw_forget |= bool(plan.forget)
        for seq in plan.seqs:
            saw_diff |= not seq.full_table
            tables.apply(seq.request_id, list(seq.block_table), seq.full_table)
            assert tables.stacked([seq.request_id])[0].tolist() == s.requests[seq.request_id].blocks
        ended = [r.request_id for r in s.update(out, {x.req.request_id: 7 for x in out.scheduled if x.samples})]
    assert saw_diff and saw_forget
    assert s.counters.preemptions_recompute > 0


def test_a_diff_for_an_unknown_table_is_refused() -> None:
    tables = BlockTables(8)
    with pytest.raises(UnknownTable):
        tables.apply("x", [1], full=False)
    with pytest.raises(ValueError, match="out of range"):
        tables.apply("x", [8], full=True)
    tables.apply("x", [3, 1], full=True)
    tables.apply("x", [], full=False)
    tables.apply("x", [5], full=False)
    tables.apply("y", [2], full=True)
    assert tables.stacked(["x", "y"]).tolist() == [[3, 1, 5], [2, 0, 0]]
