"""The GPU check (benchmarks/gpu_check.py) in its dry mode, run as a user would, so that the
script a GPU session runs cannot rot: every phase's code runs on CPU (interpreted Triton
kernels, a tiny random Llama in fp32, a real redis-server, executor and scheduler).
Only the structure of gpu_check.json is asserted, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.gpu_check import compare

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_end_to_end(tmp_path: Path, smol_dir: Path) -> None:  # smol_dir: the tokenizer's source, converted
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(tmp_path / "gpu_check.json")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "dry-run" and report["dry_run_requested"] is True and report["passed"] is True
    assert {"device_name", "torch", "cuda", "triton", "transformers"} <= report["environment"].keys()
    assert isinstance(report["wall_s"], float)
    phases = report["phases"]
    assert list(phases) == ["kernels", "e2e"]
    for name, ph in phases.items():
        assert ph["name"] == name and ph["passed"] is True and ph["error"] is None
        assert ph["wall_s"] <= ph["budget_s"]

    kernels = phases["kernels"]["details"]
    assert kernels["dtype"] == "fp32" and kernels["worst_abs_err"] <= kernels["tolerance"]
    paths = {(r["batch"], r["path"]) for r in kernels["rows"]}
    assert len(paths) == len(kernels["rows"]) >= 4
    names = {p for _, p in paths}
    assert {"unified", "split-kv x2"} <= names and any(n.startswith("auto (") for n in names)
    for row in kernels["rows"]:
        assert set(row) == {
            "batch",
            "path",
            "triton_us",
            "gbps",
            "peak_fraction",
            "sdpa_us",
            "time_ratio_vs_sdpa",
            "max_abs_err",
        }

    e2e = phases["e2e"]["details"]
    assert e2e["dtype"] == "float32" and e2e["attention_backend"] == "triton" and e2e["device"] == "cpu"
    ident = e2e["identity"]
    assert ident["passed"] and ident["identical"] == ident["total"] == len(ident["prompts"]) > 0
    assert all(
        p["first_divergence"] is None and p["served_tokens"] == p["expected_tokens"] > 0 for p in ident["prompts"]
    )
    tput = e2e["throughput"]
    assert tput["passed"] and tput["output_tokens"] == tput["requests"] * tput["max_tokens"]
    assert tput["output_tokens_per_s"] > 0
    assert (tmp_path / "kernels.log").exists() and (tmp_path / "e2e.log").exists()


def test_compare_reports_first_divergence_and_near_ties() -> None:
    logits = torch.zeros(4, 10)
    logits[2, 5], logits[2, 6] = 3.0, 2.5  # the reference picks 5 over 6 by 0.5
    assert compare([1, 2, 5, 7], [1, 2, 5, 7], logits, 0.0)["identical"]
    near = compare([1, 2, 5, 7], [1, 2, 6, 8], logits, 1.0)
    assert (near["first_divergence"], near["logit_gap"], near["near_tie"], near["passed"]) == (2, 0.5, True, True)
    far = compare([1, 2, 5, 7], [1, 2, 6, 8], logits, 0.25)
    assert (far["first_divergence"], far["near_tie"], far["passed"]) == (2, False, False)
    short = compare([1, 2, 5, 7], [1, 2], logits, 1.0)  # a stream that ended early
    assert (short["first_divergence"], short["logit_gap"], short["passed"]) == (2, None, False)
