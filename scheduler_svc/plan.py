"""A scheduler decision as the executor's StepPlan protobuf."""

from __future__ import annotations

from scheduler_svc.core.blocks import Move
from scheduler_svc.core.scheduler import SchedulerOutput
from pagedserve.executor.v1 import executor_pb2 as pb


def _moves(moves: list[Move]) -> list[pb.BlockMove]:
    return [pb.BlockMove(src_tier=m.src_tier, src=m.src, dst_tier=m.dst_tier, dst=m.dst) for m in moves]


def to_pb(out: SchedulerOutput, step_id: int) -> pb.StepPlan:
    seqs = []
    for s in out.scheduled:
        req, p = s.req, s.req.params
        seqs.append(
            pb.SeqPlan(
                request_id=req.request_id,
                token_ids=req.tokens(s.start, s.start + s.num_tokens),
                start_pos=s.start,
                block_table=req.blocks,
                sampling=pb.Sampling(
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    has_seed=p.seed is not None,
                    seed=p.seed or 0,
                ),
                sample=s.samples,
                num_generated=len(req.output_ids),
            )
        )
    return pb.StepPlan(step_id=step_id, swap_out=_moves(out.swap_out), swap_in=_moves(out.swap_in), seqs=seqs)
