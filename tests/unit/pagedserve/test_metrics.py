"""``pagedserve.metrics.view``: ``--metrics-prefix vllm`` renames the series vLLM has, on real registries of the
scheduler's metric classes, and leaves the rest (and what a loop process already renamed) alone."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.metrics import VLLM_NAMES, view
from scheduler_svc.metrics import FrontendMetrics, LoopMetrics, NamespaceMetrics


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.get("le")}


def _filled() -> CollectorRegistry:
    r = CollectorRegistry()
    loop, ns, front = LoopMetrics(r), NamespaceMetrics(r), FrontendMetrics(r)
    loop.lead("m", "e")
    loop.kv.labels("m", "e").set(0.25)
    loop.running.labels("m", "e").set(3)
    ns.set("m", 5, {"serving": 1, "draining": 1}, 1)
    front.itl.labels("m").observe(0.5)
    front.streams.labels("m").set(2)
    return r


def test_the_default_view_is_the_registry() -> None:
    r = _filled()
    assert view(r) is r and view(r, "pagedserve") is r
    with pytest.raises(ValueError, match="vllm"):
        view(r, "tgi")


def test_vllm_names_carry_the_same_values_and_the_rest_keeps_its_name() -> None:
    ours, theirs = _samples(_filled()), _samples(view(_filled(), "vllm"))
    assert theirs["vllm:num_requests_running"] == ours["pagedserve:num_requests_running"] == 3
    assert theirs["vllm:num_requests_waiting"] == 5
    assert theirs["vllm:kv_cache_usage_perc"] == theirs["vllm:gpu_cache_usage_perc"] == 0.25
    assert theirs["vllm:inter_token_latency_seconds_count"] == theirs["vllm:time_per_output_token_seconds_count"] == 1
    assert theirs["vllm:prompt_tokens_total"] == 0 and theirs["pagedserve:num_streams"] == 2
    assert theirs["pagedserve:num_executors"] == 1
    assert not [n for n in theirs for base in VLLM_NAMES if n.startswith("pagedserve:" + base)], "not under both"


def test_what_a_loop_process_already_renamed_passes_unchanged() -> None:
    """The API process re-exports its loop process's scrape, renamed there with the same flag."""
    once = view(_filled(), "vllm")
    twice = view(once, "vllm")
    assert _samples(twice) == _samples(once)
