"""Prometheus plumbing shared by both services: the name prefix, the HTTP endpoint,
and a collector that re-exports another process's metrics.

Names follow vLLM's under the ``pagedserve:`` prefix (``docs/metrics.md`` lists
every one with its vLLM counterpart). A scheduler replica is two processes, the
API and its loops: the loop process serves its metrics on a loopback port, and
the API process's ``/metrics`` includes them (``ChildCollector``), so each
service has one endpoint to scrape. A scrape never touches Redis.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)
PREFIX = "pagedserve:"
PREFIXES = ("pagedserve", "vllm")  # --metrics-prefix
# ``--metrics-prefix vllm``: our series that vLLM has, by their vLLM names (docs/metrics.md, "Under vLLM's
# names"); the others keep ``pagedserve:``. V1 observed every inter-token latency in
# time_per_output_token_seconds as well; gpu_cache_usage_perc and cpu_cache_usage_perc are V0's names, which
# older dashboards and autoscalers still query.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "num_requests_swapped": ("num_requests_swapped",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "cpu_swap_usage_perc": ("cpu_cache_usage_perc",),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "iteration_tokens_total": ("iteration_tokens_total",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}
# Seconds: from a millisecond to minutes (CPU prefills of long prompts take seconds).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


def name(metric: str) -> str:
    return PREFIX + metric


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def _text_format(app: Callable) -> Callable:
    """Always the classic text format: asked for OpenMetrics without UTF-8 names (as
    Prometheus 2 asks), prometheus_client turns the ':' of names into '_'
    (prometheus/client_python#1177), and ``pagedserve:`` names would vanish."""

    def wrapped(environ: dict, start_response: Callable) -> object:
        return app({k: v for k, v in environ.items() if k != "HTTP_ACCEPT"}, start_response)

    return wrapped


def serve(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> None:
    """``/metrics`` on ``port`` in a daemon thread (0: off)."""
    if not port:
        return
    server = make_server(host, port, _text_format(make_wsgi_app(registry)), ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, port)


class ChildCollector(Collector):
    """The metrics another process serves at ``url``, fetched at each scrape (loopback, ~1 ms)."""

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        self.url = url
        self.timeout = timeout

    def collect(self) -> Iterator[Metric]:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as resp:  # noqa: S310 - loopback
                text = resp.read().decode()
        except OSError as exc:
            log.debug("child metrics at %s unavailable: %s", self.url, exc)
            return
        yield from text_string_to_metric_families(text)


def _renamed(family: Metric, name: str) -> Metric:
    out = Metric(name, family.documentation, family.type, family.unit)
    out.samples = [
        Sample(name + s.name[len(family.name) :], s.labels, s.value, s.timestamp, s.exemplar) for s in family.samples
    ]
    return out


class AsVllm(Collector):
    """``source``'s metrics with the series vLLM has under its names (``VLLM_NAMES``); every other
    name (and one already renamed, as a loop process's) passes as it is."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []  # nothing collected at registration

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            names = VLLM_NAMES.get(family.name.removeprefix(PREFIX), ()) if family.name.startswith(PREFIX) else ()
            if not names:
                yield family
            for vllm in names:
                yield _renamed(family, "vllm:" + vllm)


def view(registry: CollectorRegistry, prefix: str = PREFIXES[0]) -> CollectorRegistry:
    """What an endpoint exposes of ``registry`` under ``--metrics-prefix``."""
    if prefix == PREFIXES[0]:
        return registry
    if prefix != "vllm":
        raise ValueError(f"metrics prefix {prefix!r}: one of {', '.join(PREFIXES)}")
    out = CollectorRegistry(auto_describe=False)
    out.register(AsVllm(registry))
    return out
