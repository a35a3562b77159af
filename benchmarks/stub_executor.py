"""``python -m benchmarks.stub_executor``: a real ``pagedserve.executor.v1.Executor`` gRPC server with no model.

``Step`` answers at once with one token per sampled sequence, so a scheduler
driving it spends its step time on scheduling, Redis and the gRPC round trip
only: that is what the scheduler-overhead benchmark measures. ``Info`` serves
the model directory's real tokenizer files, eos ids and vocabulary size, so
the scheduler's frontend works unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import uuid
from pathlib import Path

import grpc

from pagedserve import rpc
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "config.json", "vocab.json", "merges.txt", "tokenizer.model")


def _eos_ids(model_dir: Path) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists() and (eos := json.loads(path.read_text()).get("eos_token_id")) is not None:
            return sorted({int(e) for e in (eos if isinstance(eos, list) else [eos])})
    return []


class StubExecutor(pb_grpc.ExecutorServicer):
    def __init__(self, model_dir: Path, num_gpu_blocks: int, block_size: int, max_model_len: int) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.token = min(100, self.vocab_size - 1)  # any ordinary token; never eos for SmolLM2-like vocabularies
        self.info = pb.InfoResponse(
            model=f"stub:{model_dir.name}",
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_model_len=max_model_len,
            eos_token_ids=_eos_ids(model_dir),
            vocab_size=self.vocab_size,
            tokenizer_files={n: (model_dir / n).read_bytes() for n in TOKENIZER_FILES if (model_dir / n).exists()},
            device="none",
            attention_backend="stub",
            instance_id=uuid.uuid4().hex,
        )

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return self.info

    async def Step(self, request: pb.StepPlan, context: grpc.aio.ServicerContext) -> pb.StepResult:
        outputs = [pb.SeqOutput(request_id=s.request_id, token_id=self.token) for s in request.seqs if s.sample]
        return pb.StepResult(step_id=request.step_id, outputs=outputs, swapped_out=len(request.swap_out),
                             swapped_in=len(request.swap_in))


async def serve(args: argparse.Namespace) -> None:
    stub = StubExecutor(Path(args.model), args.num_gpu_blocks, args.block_size, args.max_model_len)
    server, health, _ = rpc.make_server(f"{args.host}:{args.port}",
                                        [(pb_grpc.add_ExecutorServicer_to_server, stub, SERVICE_NAME)])
    await server.start()
    await rpc.set_serving(health, [SERVICE_NAME], True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stub_executor", description=__doc__)
    p.add_argument("--model", required=True, help="model directory (tokenizer files, config.json)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--num-gpu-blocks", type=int, default=1 << 17)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1 << 16)
    asyncio.run(serve(p.parse_args(argv)))


if __name__ == "__main__":
    main()
