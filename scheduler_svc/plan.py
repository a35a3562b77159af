"""A scheduler decision as the executor's StepPlan protobuf.

Block tables travel as diffs: ``PlanBuilder`` remembers how many blocks of each
request the executor holds and sends only the new ones, or the whole table the
first time, after a preemption, and after any failure (a fresh builder).

Built before ``Scheduler.launch``: a position whose token a launched step has
not reported yet (the pipelined loop plans one step ahead) travels as
``from_last_sample``, and the executor puts its own sampled token there.
"""

from __future__ import annotations

from scheduler_svc.core.blocks import Move
from scheduler_svc.core.scheduler import SchedulerOutput
from pagedserve.executor.v1 import executor_pb2 as pb


def _moves(moves: list[Move]) -> list[pb.BlockMove]:
    return [pb.BlockMove(src_tier=m.src_tier, src=m.src, dst_tier=m.dst_tier, dst=m.dst) for m in moves]


class PlanBuilder:
    def __init__(self, epoch: int = 0, instance_id: str = "") -> None:
        self.epoch = epoch  # the loop's fencing epoch and the executor's instance, both checked there
        self.instance_id = instance_id
        self._sent: dict[str, int] = {}  # request id -> blocks of its table the executor holds
        self._first = True

    def build(self, out: SchedulerOutput, step_id: int, ended: list[str], seq: int = 0) -> pb.StepPlan:
        """``ended``: requests finished or aborted since the last plan; ``seq``: the writes of the
        executor's state in Redis this plan is built on."""
        forget = [r.request_id for r in out.preempted] + ended
        for rid in forget:
            self._sent.pop(rid, None)
        seqs = []
        for s in out.scheduled:
            req, p = s.req, s.req.params
            known = self._sent.get(req.request_id)
            table = req.blocks if known is None else req.blocks[known:]
            self._sent[req.request_id] = len(req.blocks)
            end = s.start + s.num_tokens
            unreported = end - req.num_known  # 1: the last position's token is in flight; else 0 or less
            if unreported > 1:
                raise ValueError(f"{req.request_id}: {unreported} unreported tokens in one plan (at most one)")
            seqs.append(
                pb.SeqPlan(
                    request_id=req.request_id,
                    token_ids=req.tokens(s.start, min(end, req.num_known)),
                    from_last_sample=unreported == 1,
                    start_pos=s.start,
                    block_table=table,
                    full_table=known is None,
                    sampling=pb.Sampling(
                        temperature=p.temperature,
                        top_p=p.top_p,
                        top_k=p.top_k,
                        has_seed=p.seed is not None,
                        seed=p.seed or 0,
                    ),
                    sample=s.samples,
                    num_generated=len(req.output_ids) + req.num_unreported,
                )
            )
        plan = pb.StepPlan(step_id=step_id, swap_out=_moves(out.swap_out), swap_in=_moves(out.swap_in), seqs=seqs,
                           forget=forget, reset_tables=self._first, epoch=self.epoch,
                           instance_id=self.instance_id, seq=seq)
        self._first = False
        return plan
