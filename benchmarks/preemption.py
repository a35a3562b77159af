"""Preemption cost: swap versus recompute for one request of N tokens, on the real executor.

Method: hand-made plans through the ``Step`` RPC of an executor of its own
(``start_executor``: same model, KV budget and flags as the pagedserve
arm's, but not registered in Redis, so no scheduler loop leads it and it has
seen no epoch above the probe's 0). Recompute = the prefill of N tokens (what a
recomputed request runs again when it resumes); swap = a plan that moves its
ceil(N / block) blocks device -> CPU plus one that moves them back. Each is timed as the
client-side RPC round trip (what the scheduler waits for) and as the executor's
own ``step_ms``; the median of ``reps`` runs is kept.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks.workload import Vocab
from pagedserve.dev.procs import Service, free_port
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.rpc import CHANNEL_OPTIONS


@dataclass(slots=True)
class PreemptionPoint:
    tokens: int
    blocks: int
    recompute_ms: float
    swap_ms: float  # out + in
    swap_out_ms: float
    swap_in_ms: float
    recompute_executor_ms: float
    swap_executor_ms: float


def _timed(stub: pb_grpc.ExecutorStub, plan: pb.StepPlan) -> tuple[float, float]:
    t = time.perf_counter()
    res = stub.Step(plan, timeout=600)
    return (time.perf_counter() - t) * 1e3, res.step_ms


def measure(address: str, lengths: list[int], vocab: Vocab, reps: int = 3) -> list[PreemptionPoint]:
    points: list[PreemptionPoint] = []
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.ExecutorStub(ch)
        info = stub.Info(pb.InfoRequest(), timeout=30)
        bs = info.block_size
        limit = min(info.num_gpu_blocks, info.num_cpu_blocks) * bs
        for n in sorted({min(x, limit, info.max_model_len - 1) for x in lengths if x > 0}):
            nb = -(-n // bs)
            table = list(range(nb))
            ids = [vocab.low + (i * 7919) % (vocab.size - vocab.low) for i in range(n)]
            seq = pb.SeqPlan(
                request_id="preempt-probe",
                token_ids=ids,
                start_pos=0,
                block_table=table,
                full_table=True,
                sample=True,
                sampling=pb.Sampling(temperature=0.0),
            )
            out_moves = [pb.BlockMove(src_tier=pb.TIER_DEVICE, src=b, dst_tier=pb.TIER_CPU, dst=b) for b in table]
            in_moves = [pb.BlockMove(src_tier=pb.TIER_CPU, src=b, dst_tier=pb.TIER_DEVICE, dst=b) for b in table]
            rec, sw_out, sw_in = [], [], []
            for i in range(reps):
                rec.append(_timed(stub, pb.StepPlan(step_id=3 * i, seqs=[seq])))
                sw_out.append(_timed(stub, pb.StepPlan(step_id=3 * i + 1, swap_out=out_moves)))
                sw_in.append(_timed(stub, pb.StepPlan(step_id=3 * i + 2, swap_in=in_moves)))
            med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
            points.append(
                PreemptionPoint(
                    tokens=n,
                    blocks=nb,
                    recompute_ms=med(rec, 0),
                    swap_ms=med(sw_out, 0) + med(sw_in, 0),
                    swap_out_ms=med(sw_out, 0),
                    swap_in_ms=med(sw_in, 0),
                    recompute_executor_ms=med(rec, 1),
                    swap_executor_ms=med(sw_out, 1) + med(sw_in, 1),
                )
            )
    return points


def start_executor(executor_args: list[str], log_path: Path) -> Service:
    """A fresh ``executor_svc`` started with ``executor_args``, for ``measure``; the caller stops it.

    ``--redis-url ""`` keeps it out of any namespace even when $REDIS_URL is set; ``--drain-timeout 0``
    lets it exit at once when stopped.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return Service(
        "executor_svc",
        [*executor_args, "--host", "127.0.0.1", "--redis-url", "", "--drain-timeout", "0"],
        free_port(),
        log_path,
    )
