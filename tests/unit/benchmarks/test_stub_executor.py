"""The stub executor's part in KV that moves (benchmarks/stub_executor.py), on real gRPC servers in this process:
what a plan's shape counts for the step-time model, that its role is in ``Info``, and that a pull goes through
the source's ``ReadBlocks`` checks (a live lend of that instance and epoch) before it reports ``ok``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from benchmarks.stub_executor import StepModel, StubExecutor, plan_shape
from pagedserve import rpc
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Executor"].full_name


def seq(n: int, sample: bool, last: bool = False, drafts: int = 0) -> pb.SeqPlan:
    return pb.SeqPlan(
        request_id="r", token_ids=list(range(n)), sample=sample, from_last_sample=last, draft_token_ids=[1] * drafts
    )


def test_plan_shape_counts_decodes_and_prefill_tokens() -> None:
    plan = pb.StepPlan(
        seqs=[
            seq(0, True, last=True),  # a pipelined decode: its token is the executor's last sample
            seq(1, True),  # a decode named by the scheduler
            seq(64, False),  # a prefill chunk
            seq(7, True),  # a prompt's last chunk, which samples
            seq(0, True, last=True, drafts=3),  # a decode with drafts: 4 tokens to verify
        ]
    )
    assert plan_shape(plan) == (64 + 7 + 4, 2)
    assert StepModel(2.0, 0.5, 1.0).step_ms(*plan_shape(plan)) == 2.0 + 0.5 * 75 + 2.0
    assert StepModel(pull_fixed=1.0, pull_per_block=0.25).pull_ms(8) == 3.0


def test_a_pull_reads_only_a_live_lend(smol_dir: Path) -> None:
    async def go() -> None:
        model = StepModel(1.0, 0.0, 0.0, 0.5, 0.01)
        source = StubExecutor(smol_dir, 64, 16, 1024, role="prefill", step_model=model)
        reader = StubExecutor(smol_dir, 64, 16, 1024, role="decode", step_model=model)
        servers = []
        for stub in (source, reader):
            server, _, port = rpc.make_server("127.0.0.1:0", [(pb_grpc.add_ExecutorServicer_to_server, stub, SERVICE)])
            await server.start()
            servers.append((server, f"127.0.0.1:{port}"))
        (_, src_addr), (_, dst_addr) = servers
        try:
            async with grpc.aio.insecure_channel(src_addr) as a, grpc.aio.insecure_channel(dst_addr) as b:
                src, dst = pb_grpc.ExecutorStub(a), pb_grpc.ExecutorStub(b)
                info = await src.Info(pb.InfoRequest(omit_tokenizer_files=True))
                assert info.role == "prefill" and (await dst.Info(pb.InfoRequest())).role == "decode"
                blocks = [pb.BlockRef(tier=pb.TIER_DEVICE, block=i) for i in (3, 4, 5)]

                async def pull(lend_id: str, instance: str = info.instance_id, epoch: int = 0) -> pb.PullResult:
                    p = pb.Pull(request_id="q", address=src_addr, src_instance_id=instance, src_epoch=epoch,
                                lend_id=lend_id, src=blocks, dst=[10, 11, 12])  # fmt: skip
                    (r,) = (await dst.Step(pb.StepPlan(step_id=1, pulls=[p]))).pulls
                    return r

                assert not (await pull("l1")).ok, "nothing lent yet"
                await src.Step(pb.StepPlan(step_id=1, epoch=2, lends=[pb.Lend(lend_id="l1", blocks=blocks)]))
                ok = await pull("l1", epoch=2)
                assert ok.ok and ok.bytes == 3 * reader.block_bytes > 0, ok
                stale, other = await pull("l1", epoch=1), await pull("l1", instance="someone-else")
                assert not stale.ok and "epoch" in stale.error and not other.ok and "instance_id" in other.error
                await src.Step(pb.StepPlan(step_id=2, epoch=2, unlends=["l1"]))
                gone = await pull("l1", epoch=2)
                assert not gone.ok and "FAILED_PRECONDITION" in gone.error, gone
        finally:
            for server, _ in servers:
                await server.stop(None)
            await reader.close()

    asyncio.run(go())
