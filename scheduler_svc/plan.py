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
from scheduler_svc.core.request import Params
from scheduler_svc.core.scheduler import SchedulerOutput
from pagedserve.executor.v1 import executor_pb2 as pb


def _moves(moves: list[Move]) -> list[pb.BlockMove]:
    return [pb.BlockMove(src_tier=m.src_tier, src=m.src, dst_tier=m.dst_tier, dst=m.dst) for m in moves]


def sampling_of(p: Params) -> pb.Sampling:
    return pb.Sampling(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, has_seed=p.seed is not None,
                       seed=p.seed or 0)


class PlanBuilder:
    def __init__(self, epoch: int = 0, instance_id: str = "") -> None:
        self.epoch = epoch  # the loop's fencing epoch and the executor's instance, both checked there
        self.instance_id = instance_id
        self._sent: dict[str, int] = {}  # request id -> blocks of its table the executor holds
        # request id -> its Sampling message, built once (a decode step's plan is built 256 times a step;
        # copying a built message is a third of building it)
        self._sampling: dict[str, pb.Sampling] = {}
        self._first = True

    def build(self, out: SchedulerOutput, step_id: int, ended: list[str], seq: int = 0) -> pb.StepPlan:
        """``ended``: requests finished or aborted since the last plan; ``seq``: the writes of the
        executor's state in Redis this plan is built on."""
        forget = [r.request_id for r in out.preempted] + ended
        for rid in ended:
            self._sampling.pop(rid, None)
        for rid in forget:
            self._sent.pop(rid, None)
        plan = pb.StepPlan(step_id=step_id, swap_out=_moves(out.swap_out), swap_in=_moves(out.swap_in),
                           forget=forget, reset_tables=self._first, epoch=self.epoch,
                           instance_id=self.instance_id, seq=seq)
        add = plan.seqs.add
        for s in out.scheduled:
            req = s.req
            rid = req.request_id
            sampling = self._sampling.get(rid)
            if sampling is None:
                sampling = self._sampling[rid] = sampling_of(req.params)
            known = self._sent.get(rid)
            self._sent[rid] = len(req.blocks)
            end = s.start + s.num_tokens
            unreported = end - req.num_known  # 1: the last position's token is in flight; else 0 or less
            if unreported > 1:
                raise ValueError(f"{rid}: {unreported} unreported tokens in one plan (at most one)")
            seq_pb = add(request_id=rid, start_pos=s.start, sampling=sampling, sample=s.samples,
                         num_generated=len(req.output_ids) + req.num_unreported, full_table=known is None,
                         from_last_sample=unreported == 1)
            # Empty repeated fields cost as much as the rest of the message: filled only when there is something.
            if unreported < 1 or s.num_tokens > 1:
                seq_pb.token_ids.extend(req.tokens(s.start, min(end, req.num_known)))
            if known is None:
                seq_pb.block_table.extend(req.blocks)
            elif known < len(req.blocks):
                seq_pb.block_table.extend(req.blocks[known:])
        self._first = False
        return plan
