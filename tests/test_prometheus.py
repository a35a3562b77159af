"""The Prometheus metrics as a real Prometheus server sees them.

A stack of 2 tiny Llama executors and 2 scheduler replicas (each leading one executor's
loop), every one with ``--metrics-port``, is scraped every second by Debian's
``prometheus``; 16 requests stream through both replicas, and PromQL on its HTTP API
must agree with what the clients received and what Redis holds: per-executor series
once per executor (whichever replica leads it), namespace gauges once, counters that
sum to the totals without double counting, histograms with their observations.
``promtool check metrics`` accepts each endpoint's text.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from pagedserve.dev.procs import free_port
from pagedserve.keys import Keys
from pagedserve.tiers import Tier
from tests import prometheus
from tests.conftest import make_cluster
from tests.helpers import Result, executors, greedy, pool_state, run_all, wait_all_free
from tests.prometheus import PrometheusServer, http_get, promtool_check
from tests.test_scale_out import wait_for

pytestmark = pytest.mark.skipif(
    not prometheus.available(),
    reason="needs Debian's prometheus and promtool on PATH (`make test` installs them as root)",
)

rng = random.Random(11)
N = 16
PROMPTS = [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 40))] for _ in range(N)]
MAX_TOKENS = [rng.randrange(16, 48) for _ in range(N)]
REQS = [greedy(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
# 48 blocks each: the burst spreads over both pools, and each holds its share at once.
POOL = 48  # blocks
FAST = ["--lease-ms", "3000"]
M = "pagedserve:"  # the names as docs/metrics.md gives them, and as PromQL must find them
SETTLE_S = 10  # a generous poll deadline once every target was scraped after the run


@dataclass
class Run:
    """The stack after the run, the server scraping it, and what the clients and Redis saw."""

    prom: PrometheusServer
    client: redis.Redis
    namespace: str
    endpoints: dict[str, list[str]]  # job -> host:port
    eids: list[str]  # the executors' instance ids
    results: list[Result]
    streamed: int  # tokens the clients received
    preempted: int  # preemptions, as Redis counts them
    served: dict[str, dict[str, int]]  # per executor: requests, tokens, prompt tokens finished there

    def settled(self, expected: dict[str, object]) -> None:
        got = self.prom.settle(expected, timeout=SETTLE_S)
        assert got == expected, "PromQL disagrees: " + "; ".join(
            f"{q} = {got[q]} (expected {want})" for q, want in expected.items() if got[q] != want
        )

    def by_label(self, label: str, promql: str) -> dict[str, float]:
        return {m.get(label, ""): v for m, v in self.prom.query(promql)}


def metrics_args(port: int) -> list[str]:
    return ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]


def through_both(addresses: list[str], reqs: list) -> list[Result]:
    """Half of the requests through each replica, all at once; results in request order."""
    half = len(reqs) // 2
    parts: list[list[Result]] = [[], []]
    workers = [
        threading.Thread(target=lambda i=i, r=r: parts[i].extend(run_all(addresses[i], r)))
        for i, r in enumerate((reqs[:half], reqs[half:]))
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(180)
        assert not w.is_alive(), "requests did not complete"
    return parts[0] + parts[1]


@pytest.fixture(scope="module")
def run(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    ns = "prometheus"
    tmp = tmp_path_factory.mktemp("prometheus")
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(ns)
    sched_ports, exec_ports = [free_port(), free_port()], [free_port(), free_port()]
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp / "logs",
        blocks=POOL,
        executors=0,
        executor_args=FAST,
        scheduler_args=[*FAST, *metrics_args(sched_ports[0])],
    ) as cluster:
        for port in exec_ports:
            cluster.add_executor(metrics_args(port))
        cluster.start_scheduler([*FAST, *metrics_args(sched_ports[1])])

        def leaders() -> set[str | None]:
            return {client.get(keys.executor(e).leader) for e in executors(client, ns)}

        wait_for(lambda: len(executors(client, ns)) == 2 and len(leaders() - {None}) == 2, what="one loop per replica")
        eids = executors(client, ns)
        endpoints = {
            "scheduler": [f"127.0.0.1:{p}" for p in sched_ports],
            "executor": [f"127.0.0.1:{p}" for p in exec_ports],
        }
        prom = PrometheusServer(endpoints, tmp / "prometheus")
        try:
            wait_for(prom.all_up, timeout=30, what="prometheus to scrape every target")

            results = through_both([s.address for s in cluster.schedulers], REQS)
            assert all(r.finish_reason in ("stop", "length") for r in results)
            assert [r.prompt_tokens for r in results] == [len(p) for p in PROMPTS]
            streamed = sum(len(r.token_ids) for r in results)
            assert streamed == sum(r.completion_tokens for r in results)
            free, totals = wait_all_free(client, ns)
            assert free == totals
            # Every target scraped after the stack went idle (and a manager tick later).
            idle = time.time() + 1.5
            wait_for(
                lambda: (prom.value("min(timestamp(up))") or 0) > idle,
                timeout=30,
                what="a scrape of every target after the run",
            )

            # Who served what, as Redis says (a request's last executor).
            served = {e: {"requests": 0, "tokens": 0, "prompt": 0} for e in eids}
            for r, p in zip(results, PROMPTS):
                s = served[client.hget(keys.req(r.request_id), "executor")]
                s["requests"] += 1
                s["tokens"] += len(r.token_ids)
                s["prompt"] += len(p)
            preempted = sum(
                int(client.hget(keys.counters, f) or 0) for f in ("preemptions_swap", "preemptions_recompute")
            )
            yield Run(prom, client, ns, endpoints, eids, results, streamed, preempted, served)
        finally:
            prom.stop()


def test_prometheus_stores_the_documented_names(run: Run) -> None:
    """What a real scrape stores (Prometheus negotiates OpenMetrics) is named ``pagedserve:...``."""
    names = sorted({m["__name__"] for m, _ in run.prom.query('count by (__name__) ({__name__=~"pagedserve.+"})')})
    assert names, "no pagedserve series at all"
    wrong = [n for n in names if not n.startswith(M)]
    assert not wrong, f"{len(wrong)} of {len(names)} stored names lack the {M!r} prefix: {wrong}"


def test_counters_sum_to_what_was_streamed(run: Run) -> None:
    """Each executor's counters are exported once, by whichever replica leads its loop."""
    finish: dict[str, int] = {}
    for r in run.results:
        finish[r.finish_reason] = finish.get(r.finish_reason, 0) + 1
    run.settled(
        {
            f"sum({M}generation_tokens_total)": float(run.streamed),
            f"sum({M}prompt_tokens_total)": float(sum(len(p) for p in PROMPTS)),
            f"sum({M}request_success_total)": float(N),
            f"sum({M}num_preemptions_total)": float(run.preempted),
            **{f'sum({M}request_success_total{{finished_reason="{k}"}})': float(v) for k, v in finish.items()},
            # Both sides count the same steps.
            f"sum({M}executor_steps_total) - sum({M}iteration_tokens_total_count)": 0.0,
            # One model name on every series of every endpoint.
            f'count(count by (model_name) ({{__name__=~"{M}.+"}}))': 1.0,
        }
    )


def test_per_executor_series_are_distinct_and_correct(run: Run) -> None:
    run.settled(
        {
            f"count({M}kv_cache_usage_perc)": 2.0,
            f"max({M}kv_cache_usage_perc)": 0.0,  # idle again
            f"count({M}num_requests_running)": 2.0,
            f"sum({M}num_requests_running)": 0.0,
            f"sum({M}num_requests_swapped)": 0.0,
            f'count({M}executor_kv_blocks{{tier="device"}})': 2.0,
        }
    )
    kv = run.by_label("executor", f"{M}kv_cache_usage_perc")
    assert sorted(kv) == run.eids, f"executor labels {sorted(kv)}, executors {run.eids}"
    device = {m["instance"]: v for m, v in run.prom.query(f'{M}executor_kv_blocks{{tier="device"}}')}
    assert sorted(device) == sorted(run.endpoints["executor"])
    assert sorted(device.values()) == sorted(
        float(pool_state(run.client, run.namespace, e)[1][Tier.DEVICE]) for e in run.eids
    )
    tokens = run.by_label("executor", f"sum by (executor) ({M}generation_tokens_total)")
    assert sorted(tokens) == run.eids and all(tokens[e] > 0 for e in run.eids), f"both executors served: {tokens}"
    if run.preempted:
        return  # a preempted request may have run on both: Redis names only its last executor
    for metric, key in (
        ("generation_tokens_total", "tokens"),
        ("prompt_tokens_total", "prompt"),
        ("request_success_total", "requests"),
    ):
        per = run.by_label("executor", f"sum by (executor) ({M}{metric})")
        assert per == {e: float(s[key]) for e, s in run.served.items()}, f"{metric}: {per}, Redis: {run.served}"
    # Tokens through the model: each prompt, and each generated token but the last.
    scheduled = run.prom.value(f"sum({M}iteration_tokens_total_sum)")
    prompt_total = sum(len(p) for p in PROMPTS)
    assert scheduled == prompt_total + run.streamed - N, (scheduled, prompt_total, run.streamed)


def test_namespace_gauges_are_exported_once(run: Run) -> None:
    """By the replica holding the metrics lease only, not once per replica."""
    run.settled(
        {
            f"count({M}num_requests_waiting)": 1.0,
            f"sum({M}num_requests_waiting)": 0.0,
            f'count({M}num_executors{{state="serving"}})': 1.0,
            f'sum({M}num_executors{{state="serving"}})': 2.0,
            f'sum({M}num_executors{{state="draining"}})': 0.0,
            f"count({M}num_scheduler_replicas)": 1.0,
            f"sum({M}num_scheduler_replicas)": 2.0,
        }
    )


def test_histograms_have_observations(run: Run) -> None:
    run.settled(
        {
            f"sum({M}time_to_first_token_seconds_count)": float(N),
            f"sum({M}e2e_request_latency_seconds_count)": float(N),
            f"sum({M}request_queue_time_seconds_count)": float(N),  # one first admission each
            f"count({M}executor_forward_seconds_count > 0)": 2.0,  # on both executors
            f"count({M}executor_step_seconds_count > 0)": 2.0,
            f"count({M}num_streams)": 2.0,  # one per replica, all closed
            f"sum({M}num_streams)": 0.0,
        }
    )
    # Inter-token latency: at most one observation per token after each request's first.
    itl = run.prom.value(f"sum({M}inter_token_latency_seconds_count)")
    assert itl is not None and 0 < itl <= run.streamed - N, (itl, run.streamed - N)


# Lint findings that come from following vLLM's names on purpose ("names they recognise"):
# the ``vllm:``-style colon prefix, and ``iteration_tokens_total``, a histogram in vLLM too.
# promtool has no switch for its lint (2.42); any other finding, or a parse error, fails.
VLLM_NAMING = ("metric names should not contain ':'", 'non-counter metrics should not have "_total" suffix')


def test_promtool_accepts_every_endpoint(run: Run) -> None:
    problems = {}
    for target in run.endpoints["scheduler"] + run.endpoints["executor"]:
        text = http_get(f"http://{target}/metrics").decode()
        assert M in text
        rc, said = promtool_check(text)
        other = [line for line in said.splitlines() if not any(n in line for n in VLLM_NAMING)]
        if rc not in (0, 3) or other:  # 3: lint findings only; 1: the exposition does not parse
            problems[target] = f"rc={rc}: " + "\n".join(other)
    assert not problems, "promtool check metrics:\n" + "\n".join(f"{t}: {p}" for t, p in problems.items())
