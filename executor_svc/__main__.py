"""``python -m executor_svc``: serve a model and its paged KV pool over gRPC."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from executor_svc.engine import Engine, EngineConfig
from executor_svc.model_store import DEFAULT_MODEL, resolve_model
from executor_svc.server import SERVICE_NAME, ExecutorServicer
from kernels import BACKENDS
from pagedserve import rpc
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger("executor_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m executor_svc", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help="local Hugging Face model directory (default: %(default)s)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of device KV pool (default: 512 MiB on CPU, profiled on CUDA)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use on CUDA")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="largest step; profiled on CUDA to size the pool")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=None, help="context length limit (default: the model's)")
    p.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU memory for swapped-out blocks")
    p.add_argument("--swap-dir", type=Path, default=None, help="directory for the disk swap tier (off when unset)")
    p.add_argument("--disk-swap-space", type=float, default=4.0, help="GiB of the disk swap tier")
    p.add_argument("--attention-backend", choices=BACKENDS, default="auto", help="auto: Triton on CUDA, torch on CPU")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--cache-dir", default=None, help="where the default model is converted (default: $PAGEDSERVE_CACHE or ~/.cache/pagedserve)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        p.error("--block-size must be a power of two")
    return args


async def serve(args: argparse.Namespace) -> None:
    engine = Engine(
        EngineConfig(
            model=resolve_model(args.model, args.cache_dir),
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            swap_space=args.swap_space,
            swap_dir=args.swap_dir,
            disk_swap_space=args.disk_swap_space,
            attention_backend=args.attention_backend,
            device=args.device,
            dtype=args.dtype,
        )
    )
    server, health, port = rpc.make_server(
        f"{args.host}:{args.port}", [(pb_grpc.add_ExecutorServicer_to_server, ExecutorServicer(engine), SERVICE_NAME)]
    )
    await server.start()
    await rpc.set_serving(health, [SERVICE_NAME], True)
    pool = engine.pool
    log.info(
        "executor serving %s on port %d: %s, %s attention, blocks device=%d cpu=%d disk=%d (block %d tokens, %d bytes)",
        args.model, port, engine.device, engine.backend.name, pool.count(0), pool.count(1), pool.count(2),
        engine.geometry.block_size, engine.geometry.block_bytes,
    )
    stop = await rpc.stop_on_signals()
    await stop.wait()
    await health.enter_graceful_shutdown()
    await server.stop(grace=5)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rpc.run_service(serve, args, args.log_level)


if __name__ == "__main__":
    main()
