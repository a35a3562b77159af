"""``python -m scheduler_svc``: the public Generation API and the scheduling loops.

Flags are parsed here; role ``all`` and ``frontend`` run ``replica.serve``, role ``loop``
runs ``loop_process.run_loops``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pagedserve import logs, rpc
from pagedserve.auth import SecretFile
from pagedserve.metrics import PREFIXES
from pagedserve.security import Dialer, TLSFiles
from scheduler_svc.core import spec
from scheduler_svc.core.queue import POLICIES
from scheduler_svc.core.scheduler import PREEMPTION_MODES
from scheduler_svc.frontend import tools, validate
from scheduler_svc.state import schema
from scheduler_svc.state.store import DETACH_TIMEOUT_S


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL (required)")
    p.add_argument("--namespace", default="pagedserve", help="prefix of every Redis key")
    p.add_argument("--replica-id", default=None, help="name in the loop leases (default: host-pid)")
    p.add_argument(
        "--lease-ms",
        type=int,
        default=10_000,
        help="time-to-live of this replica's leases: its loops move to another replica this long after it dies",
    )
    p.add_argument(
        "--result-ttl",
        type=int,
        default=schema.RESULT_TTL_S,
        help="seconds a finished request stays readable, and resumable",
    )
    p.add_argument(
        "--detach-timeout",
        type=float,
        default=DETACH_TIMEOUT_S,
        help="seconds a request may go without any stream attached before it is aborted",
    )
    _observability_arguments(p)
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default="text",
        help="json: one object per line, with request_id and executor fields",
    )
    _scheduling_arguments(p)
    _security_arguments(p)
    _admission_arguments(p)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    _check_security(p, args)
    _check_limits(p, args)
    return args


def _observability_arguments(p: argparse.ArgumentParser) -> None:
    """The ports and sinks: metrics, the HTTP API, traces, the step log, and which process this is."""
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus /metrics on this HTTP port (0: off); with role all it includes the "
        "loop process's metrics",
    )
    p.add_argument("--metrics-host", default="0.0.0.0", help="address the metrics port binds")
    p.add_argument(
        "--metrics-prefix",
        choices=PREFIXES,
        default=PREFIXES[0],
        help="the prefix of exported metric names: vllm exports the same series under vLLM's names "
        "(vllm:num_requests_running...) for dashboards and autoscalers written for vLLM (docs/metrics.md)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /tokenize, /metrics...) on this port (0: off; vLLM's is 8000); HTTPS with --tls-cert, API keys with "
        "--api-key-file, as the gRPC port (docs/http.md)",
    )
    p.add_argument("--http-host", default="0.0.0.0", help="address the HTTP port binds")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names the HTTP API serves the model under (vLLM's flag): the first is the id in "
        "/v1/models and in answers, a request's model may be any (or the model directory); "
        "default: the model directory, as the executor loaded it",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="allow tool_choice auto (vLLM's flag; needs --tool-call-parser): the calls are read from the "
        "model's text; without it, auto is refused (400 / INVALID_ARGUMENT naming tool_choice)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=tools.PARSERS,
        default=None,
        help="how tool_choice auto reads calls from the text (vLLM's flag): hermes reads "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (docs/http.md)',
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send OpenTelemetry traces (one per request) to this OTLP/HTTP endpoint, "
        "e.g. http://collector:4318/v1/traces (default: tracing off)",
    )
    p.add_argument("--step-log", default=None, help="append one JSON line of statistics per step to this file")
    p.add_argument(
        "--role",
        choices=("all", "frontend", "loop"),
        default="all",
        help="all: the API here and the scheduling loops in a child process; or either one alone",
    )


def _scheduling_arguments(p: argparse.ArgumentParser) -> None:
    """Which executors this replica steps, and how its loops schedule them."""
    p.add_argument(
        "--executor",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a statically configured executor (repeatable); without it, every executor registered "
        "in the namespace is served",
    )
    p.add_argument(
        "--executor-timeout",
        type=float,
        default=60.0,
        help="seconds a Step may take before its executor counts as lost",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan each step while the executor runs the previous one (a Steps stream); "
        "--no-async-scheduling: the serial loop, one unary Step at a time",
    )
    _moves_arguments(p)
    p.add_argument("--policy", choices=POLICIES, default="fcfs", help="the same on every replica of a namespace")
    p.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default="auto",
        help="what a preempted request's KV becomes: auto (swapped to the executor's CPU tier when it has room "
        "and copying out and back costs less than recomputing, both measured online), swap (to the CPU tier, "
        "then the disk tier, whenever they have room) or recompute (freed; computed again on resume)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of cached prompt prefixes across requests (hash-chained, reference-counted "
        "blocks; evicted LRU when their memory is needed); --no-enable-prefix-caching turns it off",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="running sequences per executor at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per executor step at most")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="context limit (default: each executor's); what a request may take is also capped by the largest "
        "executor pool (/v1/models' max_model_len)",
    )
    p.add_argument("--watermark", type=float, default=0.01, help="fraction of KV blocks kept free when admitting")
    _lora_arguments(p)
    p.add_argument(
        "--speculative-config",
        default="",
        metavar="JSON",
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram" | "suffix", "num_speculative_tokens": k, '
        '"prompt_lookup_min": ..., "prompt_lookup_max": ...} (docs/architecture.md, "Speculative decoding"); '
        "default: off",
    )


def _moves_arguments(p: argparse.ArgumentParser) -> None:
    """KV that moves between executors: drains, peer prefix hits, rebalancing, prefill and decode roles."""
    p.add_argument(
        "--migration",
        choices=("kv", "recompute", "off"),
        default="kv",
        help="a draining executor's requests that a serving peer has room for move at once: kv, with their "
        "KV blocks (read by the peer; recomputed only if that fails), recompute, or off (they finish "
        "where they are until the drain deadline, then move by recompute)",
    )
    p.add_argument(
        "--peer-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a request placed here whose prompt prefix a peer caches further waits for that peer's blocks "
        "when pulling them costs less than computing them (both measured online); --no-peer-prefix computes",
    )
    p.add_argument(
        "--rebalance",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serving executors move running requests with their KV to peers: before a preemption, or while "
        "their KV usage exceeds a peer's by --rebalance-gap (which requests: docs/architecture.md)",
    )
    p.add_argument(
        "--rebalance-gap",
        type=float,
        default=0.25,
        help="device KV usage (0-1) over the least loaded peer's that starts moves with --rebalance",
    )
    p.add_argument(
        "--rebalance-every-ms",
        type=int,
        default=500,
        help="how often a loop reads the peers' views to decide moves with --rebalance",
    )
    p.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=0,
        help="with prefill and decode executors (executor --role): a request whose uncached prompt is longer "
        "runs its prefill on a prefill executor, which hands its KV to a decode executor (0: never)",
    )
    p.add_argument(
        "--disagg-max-prefill-queue",
        type=int,
        default=4,
        help="requests a prefill executor may hold before long prompts run mixed again",
    )


def _lora_arguments(p: argparse.ArgumentParser) -> None:
    """LoRA adapters (vLLM's names; docs/lora.md)."""
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters of the base model")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="adapters to register for the namespace at start (a directory every executor can read)",
    )
    p.add_argument("--max-loras", type=int, default=1, help="distinct adapters running per executor step at most")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank registered")


def _check_limits(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Numbers that must be in range: one clear line at start."""
    if not args.redis_url:
        p.error("--redis-url (or $REDIS_URL) is required")
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        p.error("--max-num-seqs and --max-num-batched-tokens must be positive")
    if args.result_ttl < 1 or args.detach_timeout <= 0:
        p.error("--result-ttl and --detach-timeout must be positive")
    if not 0 <= args.http_port <= 65535:
        p.error("--http-port must be a port number (0: off)")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        p.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.max_pending_requests < 0:
        p.error("--max-pending-requests must be >= 0 (0: no limit)")
    if args.max_logprobs < 0:
        p.error("--max-logprobs must be >= 0")
    if not 0 < args.rebalance_gap <= 1:
        p.error("--rebalance-gap must be in (0, 1]")
    if args.rebalance_every_ms < 1:
        p.error("--rebalance-every-ms must be positive")
    if args.disagg_min_prompt_tokens < 0 or args.disagg_max_prefill_queue < 1:
        p.error("--disagg-min-prompt-tokens must be >= 0 and --disagg-max-prefill-queue >= 1")
    if args.max_loras < 1 or args.max_lora_rank < 1:
        p.error("--max-loras and --max-lora-rank must be positive")
    if args.lora_modules and not args.enable_lora:
        p.error("--lora-modules requires --enable-lora")
    if args.speculative_config:
        try:
            spec.parse(args.speculative_config)
        except ValueError as exc:
            p.error(f"--speculative-config: {exc}")
    if (
        min(
            args.max_stop_strings,
            args.max_stop_string_length,
            args.max_prompt_bytes,
            args.max_request_bytes,
            args.max_grammar_bytes,
            args.max_n,
        )
        < 1
    ):
        p.error(
            "--max-stop-strings, --max-stop-string-length, --max-prompt-bytes, --max-request-bytes, "
            "--max-grammar-bytes and --max-n must be positive"
        )


def _security_arguments(p: argparse.ArgumentParser) -> None:
    """TLS and authentication (docs/security.md)."""
    p.add_argument(
        "--tls-cert",
        default=None,
        metavar="PATH",
        help="serve TLS on the public port with this certificate (PEM; with --tls-key), reloaded on "
        "change or SIGHUP; with --tls-ca the same pair is the client certificate shown to executors",
    )
    p.add_argument("--tls-key", default=None, metavar="PATH", help="the private key of --tls-cert (PEM)")
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="PATH",
        help="dial executors over TLS and verify their certificates against this CA bundle (mutual "
        "TLS with --tls-cert/--tls-key); without it executors are dialled in plaintext",
    )
    p.add_argument(
        "--executor-tls-server-name",
        default=None,
        metavar="NAME",
        help="with --tls-ca: the name executors' certificates must carry, when it is not the host of "
        "the address they register (e.g. pod IPs, certificates for `executor`)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="require an API key (metadata authorization: Bearer KEY) on the public API: one key per "
        "line, several for rotation, blank lines and # comments ignored; reloaded on change or "
        "SIGHUP; health and reflection stay open",
    )
    p.add_argument(
        "--internal-token-file",
        default=None,
        metavar="PATH",
        help="send the token in this file (its first line) to executors in metadata "
        "x-pagedserve-internal-token, for executors started with the same file",
    )


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
    p.add_argument(
        "--max-pending-requests",
        type=int,
        default=0,
        metavar="N",
        help="refuse new requests with RESOURCE_EXHAUSTED (and trailing metadata retry-after, seconds) "
        "while N requests wait in this namespace's queue, whichever replicas queued them "
        "(0: no limit; the same on every replica)",
    )
    p.add_argument(
        "--max-stop-strings",
        type=int,
        default=validate.MAX_STOP_STRINGS,
        metavar="N",
        help="stop strings one request may give (sampling.stop)",
    )
    p.add_argument(
        "--max-stop-string-length",
        type=int,
        default=validate.MAX_STOP_STRING_LENGTH,
        metavar="N",
        help="characters in one stop string",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=validate.MAX_LOGPROBS,
        metavar="N",
        help="the most alternatives sampling.logprobs and sampling.prompt_logprobs may ask for (vLLM's --max-logprobs)",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=validate.MAX_N,
        metavar="N",
        help="the most completions one request may ask for (sampling.n, OpenAI's n)",
    )
    p.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=validate.MAX_PROMPT_BYTES,
        metavar="N",
        help="UTF-8 bytes of prompt text, or of all messages' roles and contents",
    )
    p.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=validate.MAX_GRAMMAR_BYTES,
        metavar="N",
        help="UTF-8 bytes of one structured-output spec (a JSON schema, regex, grammar, or the choices as a grammar)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=validate.MAX_REQUEST_BYTES,
        metavar="N",
        help="bytes of one serialized request on the public port (INVALID_ARGUMENT over it; the "
        "transport refuses messages over the larger of this and 4 MiB with RESOURCE_EXHAUSTED)",
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Each role imports only what it runs: the loops process starts without the frontend's transformers.
    if args.role == "loop":
        from scheduler_svc.loops.process import run_loops as run
    else:
        from scheduler_svc.frontend.replica import serve as run
    rpc.run_service(run, args, args.log_level, args.log_format)


if __name__ == "__main__":
    main()
