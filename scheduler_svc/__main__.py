"""``python -m scheduler_svc``: the public Generation API and the scheduling loops."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import sys
import uuid
from pathlib import Path

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry

from pagedserve import logs, metrics, rpc, tracing
from pagedserve.auth import SecretFile, api_key_interceptor
from pagedserve.keys import Keys
from pagedserve.members import Registry
from pagedserve.procs import free_port
from pagedserve.redis_check import require as require_redis
from pagedserve.security import (Dialer, ReloadingCertificate, ReloadingSSLContext, TLSFiles, reload_on_sighup,
                                 server_tls)
from scheduler_svc import codec, openai_http
from scheduler_svc.attachments import DETACH_TIMEOUT_S, Attachments
from scheduler_svc.core.queue import POLICIES
from scheduler_svc.core.scheduler import PREEMPTION_MODES, SchedulerConfig
from scheduler_svc.bus import EventBus
from scheduler_svc.frontend import Frontend
from scheduler_svc.manager import Manager
from scheduler_svc.metrics import FrontendMetrics, LoopMetrics, NamespaceMetrics
from scheduler_svc import validate
from scheduler_svc.server import SERVICE_NAME, GenerationServicer, add_to_server
from scheduler_svc.store import RedisStore
from scheduler_svc.watch import ClusterWatch

log = logging.getLogger("scheduler_svc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL (required)")
    p.add_argument("--executor", action="append", default=[], metavar="HOST:PORT",
                   help="a statically configured executor (repeatable); without it, every executor registered "
                        "in the namespace is served")
    p.add_argument("--executor-timeout", type=float, default=60.0,
                   help="seconds a Step may take before its executor counts as lost")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan each step while the executor runs the previous one (a Steps stream); "
                        "--no-async-scheduling: the serial loop, one unary Step at a time")
    p.add_argument("--policy", choices=POLICIES, default="fcfs", help="the same on every replica of a namespace")
    p.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached prompt prefixes across requests (hash-chained, reference-counted "
                        "blocks; evicted LRU when their memory is needed); --no-enable-prefix-caching turns it off")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running sequences per executor at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per executor step at most")
    p.add_argument("--max-model-len", type=int, default=0, help="context limit (default: each executor's)")
    p.add_argument("--watermark", type=float, default=0.01, help="fraction of KV blocks kept free when admitting")
    p.add_argument("--namespace", default="pagedserve", help="prefix of every Redis key")
    p.add_argument("--replica-id", default=None, help="name in the loop leases (default: host-pid)")
    p.add_argument("--lease-ms", type=int, default=10_000,
                   help="time-to-live of this replica's leases: its loops move to another replica this long "
                        "after it dies")
    p.add_argument("--result-ttl", type=int, default=codec.RESULT_TTL_S,
                   help="seconds a finished request stays readable, and resumable")
    p.add_argument("--detach-timeout", type=float, default=DETACH_TIMEOUT_S,
                   help="seconds a request may go without any stream attached before it is aborted")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics on this HTTP port (0: off); with role all it includes the "
                        "loop process's metrics")
    p.add_argument("--metrics-host", default="0.0.0.0", help="address the metrics port binds")
    p.add_argument("--http-port", type=int, default=0,
                   help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                        "/health) on this port (0: off; vLLM's is 8000); HTTPS with --tls-cert, API keys with "
                        "--api-key-file, as the gRPC port (docs/http.md)")
    p.add_argument("--http-host", default="0.0.0.0", help="address the HTTP port binds")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="send OpenTelemetry traces (one per request) to this OTLP/HTTP endpoint, "
                        "e.g. http://collector:4318/v1/traces (default: tracing off)")
    p.add_argument("--step-log", default=None, help="append one JSON line of statistics per step to this file")
    p.add_argument("--role", choices=("all", "frontend", "loop"), default="all",
                   help="all: the API here and the scheduling loops in a child process; or either one alone")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=logs.FORMATS, default="text",
                   help="json: one object per line, with request_id and executor fields")
    _security_arguments(p)
    _admission_arguments(p)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    _check_security(p, args)
    if not args.redis_url:
        p.error("--redis-url (or $REDIS_URL) is required")
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        p.error("--max-num-seqs and --max-num-batched-tokens must be positive")
    if args.result_ttl < 1 or args.detach_timeout <= 0:
        p.error("--result-ttl and --detach-timeout must be positive")
    if not 0 <= args.http_port <= 65535:
        p.error("--http-port must be a port number (0: off)")
    if args.max_pending_requests < 0:
        p.error("--max-pending-requests must be >= 0 (0: no limit)")
    if args.max_logprobs < 0:
        p.error("--max-logprobs must be >= 0")
    if min(args.max_stop_strings, args.max_stop_string_length, args.max_prompt_bytes, args.max_request_bytes,
           args.max_grammar_bytes, args.max_n) < 1:
        p.error("--max-stop-strings, --max-stop-string-length, --max-prompt-bytes, --max-request-bytes, "
                "--max-grammar-bytes and --max-n must be positive")
    return args


def _security_arguments(p: argparse.ArgumentParser) -> None:
    """TLS and authentication (docs/security.md)."""
    p.add_argument("--tls-cert", default=None, metavar="PATH",
                   help="serve TLS on the public port with this certificate (PEM; with --tls-key), reloaded on "
                        "change or SIGHUP; with --tls-ca the same pair is the client certificate shown to executors")
    p.add_argument("--tls-key", default=None, metavar="PATH", help="the private key of --tls-cert (PEM)")
    p.add_argument("--tls-ca", default=None, metavar="PATH",
                   help="dial executors over TLS and verify their certificates against this CA bundle (mutual "
                        "TLS with --tls-cert/--tls-key); without it executors are dialled in plaintext")
    p.add_argument("--executor-tls-server-name", default=None, metavar="NAME",
                   help="with --tls-ca: the name executors' certificates must carry, when it is not the host of "
                        "the address they register (e.g. pod IPs, certificates for `executor`)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="require an API key (metadata authorization: Bearer KEY) on the public API: one key per "
                        "line, several for rotation, blank lines and # comments ignored; reloaded on change or "
                        "SIGHUP; health and reflection stay open")
    p.add_argument("--internal-token-file", default=None, metavar="PATH",
                   help="send the token in this file (its first line) to executors in metadata "
                        "x-pagedserve-internal-token, for executors started with the same file")


def _check_security(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Files are read now: a typo is one clear line at start, not a refusal at the first call."""
    args.tls = TLSFiles.from_args(args)
    if (problem := args.tls.problem()) is not None:
        p.error(problem)
    if args.executor_tls_server_name and args.tls.ca is None:
        p.error("--executor-tls-server-name needs --tls-ca")
    args.api_keys = args.internal_token = None
    try:
        if args.api_key_file:
            args.api_keys = SecretFile(Path(args.api_key_file), "--api-key-file")
        if args.internal_token_file:
            args.internal_token = SecretFile(Path(args.internal_token_file), "--internal-token-file")
        args.dialer = Dialer(args.tls, args.internal_token, args.executor_tls_server_name)
    except ValueError as exc:
        p.error(str(exc))


def _admission_arguments(p: argparse.ArgumentParser) -> None:
    """Admission control and caps on what one request may ask (docs/architecture.md, "Admission")."""
    p.add_argument("--max-pending-requests", type=int, default=0, metavar="N",
                   help="refuse new requests with RESOURCE_EXHAUSTED (and trailing metadata retry-after, seconds) "
                        "while N requests wait in this namespace's queue, whichever replicas queued them "
                        "(0: no limit; the same on every replica)")
    p.add_argument("--max-stop-strings", type=int, default=validate.MAX_STOP_STRINGS, metavar="N",
                   help="stop strings one request may give (sampling.stop)")
    p.add_argument("--max-stop-string-length", type=int, default=validate.MAX_STOP_STRING_LENGTH, metavar="N",
                   help="characters in one stop string")
    p.add_argument("--max-logprobs", type=int, default=validate.MAX_LOGPROBS, metavar="N",
                   help="the most alternatives sampling.logprobs and sampling.prompt_logprobs may ask for (vLLM's "
                        "--max-logprobs)")
    p.add_argument("--max-n", type=int, default=validate.MAX_N, metavar="N",
                   help="the most completions one request may ask for (sampling.n, OpenAI's n)")
    p.add_argument("--max-prompt-bytes", type=int, default=validate.MAX_PROMPT_BYTES, metavar="N",
                   help="UTF-8 bytes of prompt text, or of all messages' roles and contents")
    p.add_argument("--max-grammar-bytes", type=int, default=validate.MAX_GRAMMAR_BYTES, metavar="N",
                   help="UTF-8 bytes of one structured-output spec (a JSON schema, regex, grammar, or the "
                        "choices as a grammar)")
    p.add_argument("--max-request-bytes", type=int, default=validate.MAX_REQUEST_BYTES, metavar="N",
                   help="bytes of one serialized request on the public port (INVALID_ARGUMENT over it; the "
                        "transport refuses messages over the larger of this and 4 MiB with RESOURCE_EXHAUSTED)")


def _caps(args: argparse.Namespace) -> validate.Caps:
    return validate.Caps(max_stop_strings=args.max_stop_strings, max_stop_string_length=args.max_stop_string_length,
                         max_prompt_bytes=args.max_prompt_bytes, max_logprobs=args.max_logprobs,
                         max_grammar_bytes=args.max_grammar_bytes, max_n=args.max_n)


def _scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """Per executor, ``max_model_len`` 0 becomes that executor's own."""
    return SchedulerConfig(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        policy=args.policy,
        preemption_mode=args.preemption_mode,
        watermark=args.watermark,
        enable_prefix_caching=args.enable_prefix_caching,
    )


async def run_loops(args: argparse.Namespace) -> None:
    """The scheduling loops alone: lead this replica's share of the executors."""
    # Each loop holds a connection while it waits on the doorbell stream.
    pool = aioredis.BlockingConnectionPool.from_url(args.redis_url, max_connections=256, timeout=None,
                                                     decode_responses=True)
    client = aioredis.Redis.from_pool(pool)
    keys = Keys(args.namespace)
    step_log = open(args.step_log, "a") if args.step_log else None  # noqa: SIM115 - lives as long as the loops
    replica = args.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    registry = CollectorRegistry()
    metrics.serve(args.metrics_port, registry, args.metrics_host)
    traces = tracing.setup("scheduler_svc", args.otlp_traces_endpoint)
    manager = Manager(RedisStore(client, args.namespace, args.result_ttl), Registry(client, keys),
                      _scheduler_config(args), replica, lease_ms=args.lease_ms, static=args.executor,
                      executor_timeout=args.executor_timeout, detach_timeout=args.detach_timeout, step_log=step_log,
                      metrics=LoopMetrics(registry), namespace_metrics=NamespaceMetrics(registry),
                      tracer=traces.tracer if traces else None, dial=args.dialer.channel,
                      async_scheduling=args.async_scheduling)
    stop = await rpc.stop_on_signals()
    reload_on_sighup([args.internal_token])
    await manager.run(stop)
    if traces is not None:
        traces.shutdown()
    await client.aclose()
    if step_log:
        step_log.close()


async def _supervise(args: argparse.Namespace, stop: asyncio.Event, metrics_port: int) -> None:
    """Run the loops as ``python -m scheduler_svc --role loop`` with the same flags, and
    keep that process alive; if it dies, other replicas take its leases meanwhile. Its
    metrics are served on ``metrics_port`` of the loopback (0: off)."""
    argv = [sys.executable, "-m", "scheduler_svc", *args.argv, "--role", "loop", "--metrics-port", str(metrics_port),
            "--metrics-host", "127.0.0.1"]
    proc: asyncio.subprocess.Process | None = None
    while not stop.is_set():
        if proc is None or proc.returncode is not None:
            if proc is not None:
                log.error("scheduling loop process exited with %s; restarting it", proc.returncode)
            proc = await asyncio.create_subprocess_exec(*argv)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass
    if proc is not None and proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()


def _public_server(args: argparse.Namespace, frontend: Frontend,
                   certificate: ReloadingCertificate | None) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """The public gRPC port: the Generation service with its limits, TLS and API keys (not started)."""
    return rpc.make_server(
        f"{args.host}:{args.port}",
        [(functools.partial(add_to_server, max_request_bytes=args.max_request_bytes), GenerationServicer(frontend),
          SERVICE_NAME)],
        reflect=True,
        credentials=certificate.credentials() if certificate else None,
        interceptors=[api_key_interceptor(args.api_keys)] if args.api_keys else (),
        max_receive_bytes=max(rpc.PUBLIC_MAX_MESSAGE_BYTES, args.max_request_bytes),
        max_concurrent_streams=rpc.PUBLIC_MAX_CONCURRENT_STREAMS,
    )


async def serve(args: argparse.Namespace) -> None:
    """The public API (and, with role ``all``, the loops in a child process).

    The loops run in their own process, as vLLM separates its engine core from
    its API server: streaming and detokenizing for hundreds of requests must
    not stall the steps the executors wait on. Both sides talk only via Redis.
    The API answers at once; health says SERVING once an executor serves.
    """
    await require_redis(args.redis_url)  # wrong or missing credentials: one clear line, exit 2
    if args.role == "loop":
        await run_loops(args)
        return
    # Thousands of concurrent streams share a bounded pool and wait for a free
    # connection instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(args.redis_url, max_connections=64, timeout=None,
                                                     decode_responses=True)
    client = aioredis.Redis.from_pool(pool)
    store = RedisStore(client, args.namespace, args.result_ttl)
    watch = ClusterWatch(Registry(client, store.keys), args.max_model_len, dial=args.dialer.channel)
    bus = EventBus(store)
    attachments = Attachments(store, args.policy, args.detach_timeout)
    registry = CollectorRegistry()
    loop_metrics_port = free_port() if args.metrics_port and args.role == "all" else 0
    if loop_metrics_port:
        registry.register(metrics.ChildCollector(f"http://127.0.0.1:{loop_metrics_port}/metrics"))
    metrics.serve(args.metrics_port, registry, args.metrics_host)
    traces = tracing.setup("scheduler_svc", args.otlp_traces_endpoint)
    frontend = Frontend(store, bus, watch, args.policy, attachments, FrontendMetrics(registry),
                        traces.tracer if traces else None, caps=_caps(args), max_pending=args.max_pending_requests)
    certificate = server_tls(args.tls, verify_clients=False)
    server, health, port = _public_server(args, frontend, certificate)
    https = ReloadingSSLContext(certificate.cert, certificate.key) if args.http_port and certificate else None
    reload_on_sighup([certificate, https, args.api_keys, args.internal_token])
    await rpc.set_serving(health, [SERVICE_NAME], False)
    stop = await rpc.stop_on_signals()
    try:
        http = await openai_http.serve(frontend, args.http_host, args.http_port, api_keys=args.api_keys, tls=https,
                                       max_request_bytes=args.max_request_bytes) if args.http_port else None
    except OSError as exc:
        raise SystemExit(f"error: {exc}") from None  # one line, exit 1
    await server.start()
    tasks = [asyncio.create_task(bus.run(stop)), asyncio.create_task(watch.run(stop, health, [SERVICE_NAME])),
             asyncio.create_task(attachments.run(stop))]
    if args.role == "all":
        tasks.append(asyncio.create_task(_supervise(args, stop, loop_metrics_port)))
    log.info("scheduler serving on port %d (role %s, namespace %s, %s, %s, executors: %s)", port, args.role,
             args.namespace, args.policy, args.preemption_mode, ", ".join(args.executor) or "registered")
    log.info("public port: %s, %s; executors dialled %s%s", "TLS" if certificate else "plaintext",
             "API key required" if args.api_keys else "no API key", "over TLS" if args.tls.ca else "in plaintext",
             " with the internal token" if args.internal_token else "")
    if http is not None:
        log.info("OpenAI-compatible HTTP on port %d (%s, %s)", http.port, "HTTPS" if http.tls else "plain HTTP",
                 "API key required" if args.api_keys else "no API key")
    await stop.wait()
    # Drain: open streams end UNAVAILABLE (HTTP: an error event) with where to resume; their
    # requests go on, and this replica's loops hand their leases over as the loop process stops.
    frontend.drain()
    await health.enter_graceful_shutdown()
    await asyncio.gather(server.stop(grace=5), *([http.stop()] if http is not None else []))
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()
    if traces is not None:
        traces.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rpc.run_service(serve, args, args.log_level, args.log_format)


if __name__ == "__main__":
    main()
