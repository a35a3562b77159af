"""What replayable seeds cost the executor: ``executor_svc.sampler.sample`` seeded vs unseeded.

Since every sampled request gets a seed at submission (so a recompute after a
failure yields the same tokens), every sampled row now draws its noise from a
``torch.Generator`` seeded with ``(seed, num_generated)`` instead of the global
RNG. This times ``sample`` on the model's vocabulary (fp32 logits, temperature
0.8, top-k 50) at several batch sizes with every row seeded (today's behaviour)
and with none (what an unseeded request cost before). Calls rotate between
unseeded, seeded and unseeded again; times are the median of ``reps`` per
series, ratios the median of the per-rotation ratios (each call against the
unseeded one just before it, so load that changes over the run cancels). The
second unseeded series gives the noise floor of the comparison (an A/A ratio:
the same code timed twice).

The extra time is set against a decode step's forward at the same batch: from
the pagedserve run's step log when it has decode-only steps near that batch
(a local linear fit of ``forward_ms`` on ``running`` within +-25% of it; the
arm samples greedily, so its ``forward_ms`` holds no sampling beyond an
argmax), else a decode forward of the model itself (transformers, ``context``
tokens of KV per row) measured here.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from executor_svc.sampler import Sampling, sample

NEIGHBOURHOOD = 0.25  # step-log rows within +-25% of a batch size stand for it
MIN_STEPS = 3
RATIO_BATCH = 32  # the batch of summary.json's seeded_sampling_cost_ratio


@dataclass(slots=True)
class SamplingConfig:
    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    reps: int = 7
    temperature: float = 0.8
    top_k: int = 50
    context: int = 64  # KV tokens per row of a measured decode forward (the quick workload's mean length)


@dataclass(slots=True)
class SamplingPoint:
    batch: int
    vocab: int
    unseeded_ms: float  # median per sample() call
    seeded_ms: float
    ratio: float  # seeded / unseeded, median of the per-rotation ratios
    noise_ratio: float  # unseeded again / unseeded, the same way: what "within noise" means here
    extra_ms: float  # (ratio - 1) x unseeded_ms: what the seeds cost per step
    forward_ms: float | None  # a decode step's forward at this batch
    forward_source: str  # "step log (N decode steps, batch a-b)", "measured (transformers)" or ""
    seeds_share_of_forward: float | None  # extra_ms / forward_ms
    sampling_share_of_forward: float | None  # seeded_ms / forward_ms: sampling itself against the forward


def _params(batch: int, cfg: SamplingConfig, seeded: bool) -> list[Sampling]:
    return [Sampling(cfg.temperature, 1.0, cfg.top_k, i + 1 if seeded else None) for i in range(batch)]


@dataclass(slots=True)
class Timing:
    unseeded_ms: float
    seeded_ms: float
    ratio: float
    noise_ratio: float


def time_sample(logits: torch.Tensor, cfg: SamplingConfig) -> Timing:
    """One warm-up each, then ``reps`` rotations of unseeded, seeded, unseeded again."""
    b = logits.shape[0]
    seeded, unseeded, generated = _params(b, cfg, True), _params(b, cfg, False), [10] * b
    modes = (unseeded, seeded, unseeded)
    for params in modes[:2]:
        sample(logits, params, generated)
    times: list[list[float]] = [[], [], []]
    for _ in range(cfg.reps):
        for series, params in zip(times, modes):
            t = time.perf_counter()
            sample(logits, params, generated)
            series.append((time.perf_counter() - t) * 1e3)
    before, with_seeds, after = times
    return Timing(
        statistics.median(before),
        statistics.median(with_seeds),
        statistics.median([s / u for s, u in zip(with_seeds, before)]),
        statistics.median([a / u for a, u in zip(after, before)]),
    )


def forward_from_steps(steps: list[dict[str, float]], batch: int) -> tuple[float | None, str]:
    """A decode step's ``forward_ms`` at ``batch`` from the step log, if it has decode-only steps near it."""
    lo, hi = batch * (1 - NEIGHBOURHOOD), batch * (1 + NEIGHBOURHOOD)
    rows = [r for r in steps if r["scheduled_tokens"] == r["running"] and lo <= r["running"] <= hi]
    if len(rows) < MIN_STEPS:
        return None, ""
    x = np.array([r["running"] for r in rows], dtype=float)
    y = np.array([r["forward_ms"] for r in rows], dtype=float)
    if len(set(x)) < 2:
        value = float(np.median(y))
    else:
        slope, intercept = np.polyfit(x, y, 1)
        value = float(slope * batch + intercept)
    return value, f"step log ({len(rows)} decode steps, batch {int(x.min())}-{int(x.max())})"


@torch.inference_mode()
def measure_forward(model: torch.nn.Module, batch: int, context: int, reps: int = 3) -> float:
    """Median ms of one decode forward at ``batch`` rows behind ``context`` cached tokens each."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(3, vocab, (batch, context), generator=gen)
    out = model(prompt, use_cache=True)
    cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        t = time.perf_counter()
        out = model(nxt, cache=cache, use_cache=True)
        times.append((time.perf_counter() - t) * 1e3)
        cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
    return statistics.median(times[1:])


def _forwards(
    model: Callable[[], torch.nn.Module], cfg: SamplingConfig, steps: list[dict[str, float]]
) -> dict[int, tuple[float | None, str]]:
    found = {b: forward_from_steps(steps, b) for b in cfg.batches}
    for b in [b for b, (ms, _) in found.items() if ms is None]:
        found[b] = measure_forward(model(), b, cfg.context), f"measured (transformers, {cfg.context} KV tokens/row)"
    return found


def run(
    model_dir: Path,
    cfg: SamplingConfig,
    steps: list[dict[str, float]],
    threads: int,
    model: Callable[[], torch.nn.Module] | None = None,
) -> list[SamplingPoint]:
    """``model``: returns the transformers model for decode forwards the step log lacks (default: loads it)."""
    torch.set_num_threads(threads)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    gen = torch.Generator().manual_seed(0)
    points = []
    for b in cfg.batches:
        logits = torch.randn(b, vocab, generator=gen) * 3.0  # a spread like a real model's logits
        t = time_sample(logits, cfg)
        # The extra time from the paired ratio: robust to load that differs between the series' medians.
        points.append(
            SamplingPoint(
                b,
                vocab,
                t.unseeded_ms,
                t.seeded_ms,
                t.ratio,
                t.noise_ratio,
                (t.ratio - 1) * t.unseeded_ms,
                None,
                "",
                None,
                None,
            )
        )
        print(
            f"[sampling_cost] batch {b}: unseeded {t.unseeded_ms:.2f} ms, seeded {t.seeded_ms:.2f} ms "
            f"({t.ratio:.3f}x; A/A {t.noise_ratio:.3f}x)",
            flush=True,
        )
    if model is None:
        from benchmarks.arm_hf import load_model

        model = functools.partial(load_model, model_dir, threads)
    forwards = _forwards(functools.cache(model), cfg, steps)
    for p in points:
        p.forward_ms, p.forward_source = forwards[p.batch]
        if p.forward_ms:
            p.seeds_share_of_forward = p.extra_ms / p.forward_ms
            p.sampling_share_of_forward = p.seeded_ms / p.forward_ms
    return points


def ratio_at(points: list[SamplingPoint], batch: int = RATIO_BATCH) -> float | None:
    return next((p.ratio for p in points if p.batch == batch), None)


def share_at(points: list[SamplingPoint], batch: int = RATIO_BATCH) -> float | None:
    return next((p.seeds_share_of_forward for p in points if p.batch == batch), None)
