"""``python -m executor_svc``: serve a model and its paged KV pool over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from pathlib import Path

import redis.asyncio as aioredis
import torch
from prometheus_client import CollectorRegistry

from executor_svc import lean, linear
from executor_svc.context import ContextTooLong
from executor_svc.engine import Engine, EngineConfig
from executor_svc.lifecycle import Lifecycle, Registration, quiet
from executor_svc.lora import LoraConfig
from executor_svc.metrics import ExecutorMetrics
from executor_svc.model_store import DEFAULT_MODEL, cache_dir, resolve_model
from executor_svc.runner import TorchThread
from executor_svc.server import SERVICE_NAME, ExecutorServicer, add_to_server
from executor_svc.transfer import Puller
from paged_kernels import BACKENDS
from paged_kernels.cpu_attention import KernelUnavailable
from pagedserve import heap, logs, metrics, rpc
from pagedserve.auth import SecretFile, internal_token_interceptor
from pagedserve.keys import Keys
from pagedserve.members import ROLES, Registry
from pagedserve.redis_check import require as require_redis
from pagedserve.security import Dialer, TLSFiles, reload_on_sighup, server_tls
from pagedserve.tiers import Tier

log = logging.getLogger("executor_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m executor_svc", description=__doc__)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this HTTP port (0: off)")
    p.add_argument("--metrics-host", default="0.0.0.0", help="address the metrics port binds")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=logs.FORMATS, default="text", help="json: one object per line")
    _engine_arguments(p)
    _membership_arguments(p)
    _security_arguments(p)
    _lora_arguments(p)
    args = p.parse_args(argv)
    _check_security(p, args)
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        p.error("--block-size must be a power of two")
    if args.drain_timeout < 0:
        p.error("--drain-timeout must be >= 0")
    if args.read_blocks_delay_ms < 0:
        p.error("--read-blocks-delay-ms must be >= 0")
    if min(args.max_loras, args.max_lora_rank, args.max_cpu_loras) < 1:
        p.error("--max-loras, --max-lora-rank and --max-cpu-loras must be positive")
    if args.advertise_address is None:
        args.advertise_address = f"{socket.gethostname()}:{args.port}"
    return args


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model, its device and dtype, and the paged KV pool with its swap tiers."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="local Hugging Face model directory (default: %(default)s)")
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="bytes of device KV pool (default: 512 MiB on CPU, profiled on CUDA)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory to use on CUDA")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="largest step; profiled on CUDA to size the pool"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length limit (default: the model's); refused at start if the KV pool cannot hold one "
        "request this long",
    )
    p.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU memory for swapped-out blocks")
    p.add_argument("--swap-dir", type=Path, default=None, help="directory for the disk swap tier (off when unset)")
    p.add_argument("--disk-swap-space", type=float, default=4.0, help="GiB of the disk swap tier")
    p.add_argument(
        "--attention-backend",
        choices=BACKENDS,
        default="auto",
        help="auto: Triton on CUDA, else the compiled cpu kernel (the torch reference where it cannot be built); "
        "cpu: that kernel or exit with the reason; torch: the reference (gather + SDPA)",
    )
    p.add_argument(
        "--cpu-linear",
        choices=linear.CHOICES,
        default="auto",
        help="the linear layers on CPU, weights prepacked once: dnnl (oneDNN's own library, called directly, as "
        "vLLM's CPU backend), onednn (through torch's), torch (F.linear); auto: dnnl where it builds, else onednn",
    )
    p.add_argument(
        "--model-impl",
        choices=lean.CHOICES,
        default="auto",
        help="the forward pass: lean (Llama and Qwen2 in a few ops a layer, same logits as transformers'; "
        "executor_svc/lean.py), transformers (its eager model), or auto: lean where it supports the model",
    )
    p.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="glibc's malloc keeps freed memory for the next step instead of unmapping it (no page faults on "
        "every step's temporaries; pagedserve/heap.py)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where the default model is converted and the cpu attention kernel built (default: $PAGEDSERVE_CACHE or "
        "~/.cache/pagedserve)",
    )


def _membership_arguments(p: argparse.ArgumentParser) -> None:
    """How schedulers find this executor (docs/architecture.md, "Membership"), and how it leaves."""
    p.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="register in this Redis so that schedulers find this executor (default: $REDIS_URL; "
        "unset: only schedulers started with --executor reach it)",
    )
    p.add_argument(
        "--advertise-address",
        default=None,
        metavar="HOST:PORT",
        help="where schedulers reach this executor (default: this host's name and --port; in "
        "Kubernetes pass the pod IP)",
    )
    p.add_argument("--namespace", default="pagedserve", help="the schedulers' namespace to join")
    p.add_argument(
        "--lease-ms",
        type=int,
        default=10_000,
        help="time-to-live of the membership record; a heartbeat renews it every third of it",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=45.0,
        help="seconds after SIGTERM to let running requests finish before they move elsewhere "
        "(fits Kubernetes' 75 s grace period after a 15 s preStop)",
    )


def _lora_arguments(p: argparse.ArgumentParser) -> None:
    """LoRA adapters (vLLM's names; docs/lora.md): the executor's capacity for them."""
    p.add_argument(
        "--role",
        choices=ROLES,
        default="mixed",
        help="prefill: compute long prompts and hand their KV to a decode executor; decode: everything else, and "
        "what prefill executors hand over; mixed: everything (docs/architecture.md, 'Prefill and decode')",
    )
    p.add_argument(
        "--read-blocks-delay-ms",
        type=float,
        default=0.0,
        help="fault injection for tests: serve peers' block reads one block a chunk, each after this pause, so "
        "a test can kill a party mid-copy (0: off, full-speed chunks)",
    )
    p.add_argument("--enable-lora", action="store_true", help="apply LoRA adapters the step plans name")
    p.add_argument("--max-loras", type=int, default=1, help="adapter slots on the device: distinct adapters per step")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank the slots hold")
    p.add_argument("--max-cpu-loras", type=int, default=4, help="adapters kept in host memory, least recently used out")


def _security_arguments(p: argparse.ArgumentParser) -> None:
    """TLS and the internal token (docs/security.md)."""
    p.add_argument(
        "--tls-cert",
        default=None,
        metavar="PATH",
        help="serve TLS with this certificate (PEM; with --tls-key); reloaded on change or SIGHUP",
    )
    p.add_argument("--tls-key", default=None, metavar="PATH", help="the private key of --tls-cert (PEM)")
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="PATH",
        help="with --tls-cert: require a client certificate signed by this CA bundle (mutual TLS): "
        "only schedulers holding one can connect, health checks included",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        metavar="PATH",
        help="require this shared token (first line of the file) in metadata "
        "x-pagedserve-internal-token on every call but health; the protection when TLS is off, "
        "and checked too when it is on; reloaded on change or SIGHUP",
    )
    p.add_argument(
        "--peer-tls-ca",
        default=None,
        metavar="PATH",
        help="with --tls-cert: the CA bundle that signs peer executors' certificates, for KV migration "
        "(default: --tls-ca); this executor presents --tls-cert to them as its client certificate",
    )
    p.add_argument(
        "--peer-tls-server-name",
        default=None,
        metavar="NAME",
        help="the name expected in peers' certificates when it is not the host of their address",
    )


def _check_security(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Files are read now: a typo is one clear line at start, not a refusal at the first call."""
    args.tls = TLSFiles.from_args(args)
    if (problem := args.tls.problem()) is not None:
        p.error(problem)
    if args.tls.ca is not None and args.tls.cert is None:
        p.error("--tls-ca needs --tls-cert and --tls-key (the executor's own certificate)")
    args.internal_token = None
    if args.internal_token_file:
        try:
            args.internal_token = SecretFile(Path(args.internal_token_file), "--internal-token-file")
        except ValueError as exc:
            p.error(str(exc))


# Once drained nothing is placed here and nothing lent, so the RPCs still open are the schedulers' idle Step
# streams, which they close when they see the membership record gone: up to a manager tick (~1 s) later, which
# would only delay the exit (and made a drain that moved KV exit up to 0.7 s after the same drain by recompute,
# by where that tick fell). A short grace lets a last reply go out; then what is open is cancelled.
DRAINED_GRACE_S = 0.25


async def _health(servicer: ExecutorServicer, health: object, stop: asyncio.Event) -> None:
    """NOT_SERVING while draining and after the engine failed."""
    serving = True
    while not stop.is_set():
        if servicer.lifecycle.serving != serving:
            serving = servicer.lifecycle.serving
            await rpc.set_serving(health, [SERVICE_NAME], serving)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def _drain(args: argparse.Namespace, servicer: ExecutorServicer, registration: Registration | None) -> None:
    servicer.lifecycle.drain(args.drain_timeout)
    log.info("draining: no new requests; running ones have %.0f s to finish or move", args.drain_timeout)
    if registration is not None:
        await registration.beat()  # schedulers see "draining" now, not a heartbeat later
        await registration.announce_drain()  # and its loop, at its next turn
        await registration.drained(lambda: bool(servicer.lends))  # peers may still read what moved
    else:
        await quiet(servicer.lifecycle, lambda: servicer.last_step)


def _engine(args: argparse.Namespace) -> Engine:
    return Engine(
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
            kernel_cache=cache_dir(args.cache_dir),
            cpu_linear=args.cpu_linear,
            model_impl=args.model_impl,
            device=args.device,
            dtype=args.dtype,
            lora=LoraConfig(args.max_loras, args.max_lora_rank, max(args.max_cpu_loras, args.max_loras))
            if args.enable_lora
            else None,
        )
    )


def _log_serving(args: argparse.Namespace, engine: Engine, port: int, *, tls: bool) -> None:
    """How the port is protected, then what this executor serves and its pool's size per tier."""
    pool = engine.pool
    log.info(
        "port %d: %s, %s",
        port,
        "mutual TLS" if args.tls.ca else "TLS" if tls else "plaintext",
        "internal token required" if args.internal_token else "no internal token",
    )
    log.info(
        "executor %s serving %s on port %d: %s, %s attention, blocks device=%d cpu=%d disk=%d (block %d tokens, "
        "%d bytes)",
        engine.instance_id,
        args.model,
        port,
        engine.device,
        engine.backend.name,
        pool.count(0),
        pool.count(1),
        pool.count(2),
        engine.geometry.block_size,
        engine.geometry.block_bytes,
    )


def _puller(args: argparse.Namespace, engine: Engine) -> Puller | None:
    """The client this executor reads peers' KV with: TLS when it serves TLS (peers do too),
    with its own certificate as the client one, and the internal token."""
    tls = args.tls
    if tls.cert is None:
        return Puller(Dialer(TLSFiles(), args.internal_token).channel, lambda: engine.instance_id)
    ca = Path(args.peer_tls_ca) if args.peer_tls_ca else tls.ca
    if ca is None:
        log.warning("TLS without --tls-ca or --peer-tls-ca: peers cannot be verified; moved requests recompute")
        return None
    dialer = Dialer(TLSFiles(tls.cert, tls.key, ca), args.internal_token, args.peer_tls_server_name)
    return Puller(dialer.channel, lambda: engine.instance_id)


async def serve(args: argparse.Namespace) -> None:
    await require_redis(args.redis_url)  # wrong or missing credentials: one clear line, exit 2
    if args.keep_freed_memory and heap.keep_freed_memory():
        log.info("malloc keeps freed memory (mmap threshold %d MiB)", heap.MMAP_THRESHOLD >> 20)
    torch_thread = TorchThread()
    try:
        engine = torch_thread.call(_engine, args)
    except (ContextTooLong, KernelUnavailable) as exc:
        raise SystemExit(f"error: {exc}") from None  # one line, exit 1
    torch.set_num_threads(1)  # the event loop's own torch work (blocks for peers) starts no OpenMP team (runner.py)
    registry = CollectorRegistry()
    executor_metrics = ExecutorMetrics(registry, engine.cfg.model.name)
    executor_metrics.pools({t: engine.pool.count(t) for t in Tier})
    metrics.serve(args.metrics_port, registry, args.metrics_host)
    servicer = ExecutorServicer(
        engine,
        Lifecycle(),
        executor_metrics,
        _puller(args, engine),
        args.read_blocks_delay_ms / 1000,
        args.role,
        torch_thread,
    )
    certificate = server_tls(args.tls, verify_clients=True)
    server, health, port = rpc.make_server(
        f"{args.host}:{args.port}",
        [(add_to_server, servicer, SERVICE_NAME)],
        credentials=certificate.credentials() if certificate else None,
        interceptors=[internal_token_interceptor(args.internal_token)] if args.internal_token else (),
    )
    reload_on_sighup([certificate, args.internal_token])
    await server.start()
    heap.settle()  # the model and every module are in: keep the collector off the steps
    await rpc.set_serving(health, [SERVICE_NAME], True)
    _log_serving(args, engine, port, tls=certificate is not None)
    stop = await rpc.stop_on_signals()
    done = asyncio.Event()
    tasks = [asyncio.create_task(_health(servicer, health, done))]
    client, registration = None, None
    if args.redis_url:
        client = aioredis.from_url(args.redis_url, decode_responses=True)
        registration = Registration(
            Registry(client, Keys(args.namespace)),
            servicer.lifecycle,
            lambda: servicer.member(args.advertise_address),
            servicer.renew_instance,
            args.lease_ms,
        )
        tasks.append(asyncio.create_task(registration.run(done)))
        log.info("registering as %s in namespace %s", args.advertise_address, args.namespace)
    await stop.wait()
    await _drain(args, servicer, registration)
    done.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    if registration is not None:
        await registration.leave()
    if client is not None:
        await client.aclose()
    await health.enter_graceful_shutdown()
    await server.stop(grace=DRAINED_GRACE_S)
    log.info("drained; exiting")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rpc.run_service(serve, args, args.log_level, args.log_format)


if __name__ == "__main__":
    main()
