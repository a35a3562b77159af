"""Against the machine, not only against peers: model-runner ratio, compute roofline, executor duty cycle.

Three informational figures (no target, nothing asserted):

1. **Model-runner ratio.** The executor's own decode step (``executor_svc.engine.Engine.step`` in this
   process: a hand-made plan of one new token per row behind ``context`` tokens prefilled through the
   same engine, greedy) against transformers' eager decode step (the same weights, fp32, one forward
   of one new token per row with a ``DynamicCache`` holding ``context`` tokens per row, plus the argmax
   a greedy step takes), at each batch size. Calls alternate executor, transformers, executor ... after
   one warm-up each, so load that changes during the run hits both; times are each series' median and
   the ratio (executor / transformers) the median of the per-pair ratios. After each call the step's
   position is reused (the engine rewrites the same KV slot; the cache is cropped back to ``context``),
   so every rep sees the same context.
2. **Roofline.** The achievable fp32 GEMM rate of this machine (``torch.mm`` of two square fp32
   matrices, best of ``gemm_reps``) and the model's FLOPs per output token,
   ``2 x matmul parameters + 2 x 2 x layers x context x hidden``: every parameter used as a matrix
   multiply once per token (all parameters but the input embedding table, which is a lookup; the output
   projection counts even when it is tied to the embeddings) plus attention's QK^T and AV over
   ``context`` cached tokens. ``context`` is the mean context an output token of the workload sees
   (prompt + tokens generated before it). Tokens/s x FLOPs/token / GEMM FLOP/s is the fraction of the
   machine's compute that output tokens account for; prefill FLOPs are not counted.
3. **Executor duty cycle in the real run**, from the pagedserve arm's step log: time inside ``Step``
   (the executor's own ``step_ms``) over the wall time the log spans, overall and per number of running
   sequences.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.config import kv_bytes_per_token
from benchmarks.workload import Workload
from executor_svc.engine import Engine, EngineConfig
from executor_svc.plan import SeqInput, StepInput
from pagedserve import heap

GEMM_SIZE = 2048
RATIO_BATCH = 32  # the batch of summary.json's model_runner_ratio_32


@dataclass(slots=True)
class MachineConfig:
    batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    reps: int = 7  # timed pairs per batch
    context: int = 64  # cached tokens per row of a timed decode step
    gemm_size: int = GEMM_SIZE
    gemm_reps: int = 5
    block_size: int = 16


@dataclass(slots=True)
class RunnerPoint:
    batch: int
    context: int
    executor_ms: float  # median Engine.step, in the pairs
    transformers_ms: float  # median model forward + argmax
    ratio: float  # executor / transformers, median of the per-pair ratios
    executor_alone_ms: float  # median Engine.step, steps back to back (as vLLM's step is timed: runner_vs_vllm)


@dataclass(slots=True)
class FlopsPerToken:
    flops: float
    context: float  # the mean context the attention term assumes
    matmul_params: int
    attention_flops: float
    layers: int
    hidden: int
    formula: str = "2 x matmul_params + 2 x 2 x layers x context x hidden"


@dataclass(slots=True)
class MachineResult:
    runner: list[RunnerPoint]
    gemm_flops_per_s: float
    gemm_size: int
    gemm_reps: int
    flops: FlopsPerToken
    threads: int

    def ratio_at(self, batch: int = RATIO_BATCH) -> float | None:
        return next((p.ratio for p in self.runner if p.batch == batch), None)


@dataclass(slots=True)
class DutyPoint:
    running: int
    steps: int
    duty: float  # sum(step_ms) / sum(wall time of those steps)


# -- 1. model-runner ratio -----------------------------------------------------------------------------


def _prompt(batch: int, context: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, context), generator=gen)


class EngineRunner:
    """The executor's engine with ``max_batch`` rows of ``context`` tokens prefilled; times decode steps."""

    def __init__(self, model_dir: Path, cfg: MachineConfig, max_batch: int) -> None:
        per_row = -(-(cfg.context + 1) // cfg.block_size)
        budget = (max_batch * per_row + 1) * cfg.block_size * kv_bytes_per_token(model_dir)
        self.engine = Engine(EngineConfig(model_dir, block_size=cfg.block_size, kv_cache_memory=budget))
        self.context = cfg.context
        self.tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(max_batch)]
        self.prompt = _prompt(max_batch, cfg.context, self.engine.vocab_size)
        self._prefill()

    def _prefill(self) -> None:
        seqs = [
            SeqInput(f"row-{i}", row.tolist(), 0, self.tables[i], sample=False) for i, row in enumerate(self.prompt)
        ]
        self.engine.step(StepInput(seqs=seqs))

    def decode_ms(self, batch: int) -> float:
        """One decode step of the first ``batch`` rows, each writing position ``context`` again."""
        seqs = [SeqInput(f"row-{i}", [int(self.prompt[i, -1])], self.context, self.tables[i]) for i in range(batch)]
        t = time.perf_counter()
        self.engine.step(StepInput(seqs=seqs))
        return (time.perf_counter() - t) * 1e3


class HFRunner:
    """transformers' eager model with a DynamicCache of ``context`` tokens per row, one per batch size."""

    def __init__(self, model: torch.nn.Module, cfg: MachineConfig) -> None:
        self.model = model
        self.context = cfg.context
        self.caches: dict[int, tuple[object, torch.Tensor]] = {}

    @torch.inference_mode()
    def prefill(self, batch: int) -> None:
        prompt = _prompt(batch, self.context, self.model.config.vocab_size)
        out = self.model(prompt, use_cache=True)
        self.caches[batch] = (out.cache, prompt[:, -1:])

    @torch.inference_mode()
    def decode_ms(self, batch: int) -> float:
        cache, nxt = self.caches[batch]
        t = time.perf_counter()
        out = self.model(nxt, cache=cache, use_cache=True)
        out.logits[:, -1].argmax(-1)
        ms = (time.perf_counter() - t) * 1e3
        out.cache.crop(-1)  # back to ``context`` tokens: the next rep sees the same context
        return ms


def time_pairs(engine: EngineRunner, hf: HFRunner, batch: int, reps: int, context: int) -> RunnerPoint:
    """One warm-up each, then ``reps`` pairs: executor step, transformers step; then ``reps`` executor steps back to
    back. A pair's transformers forward leaves the caches and the OpenMP threads as its own run left them, which cost
    the executor's next step 5-10% here (2026-12-06); vLLM's step (``benchmarks/vllm_steps.py``) is timed back to
    back, so the comparison with it takes the second series."""
    engine.decode_ms(batch)
    hf.decode_ms(batch)
    ex, tr = [], []
    for _ in range(reps):
        ex.append(engine.decode_ms(batch))
        tr.append(hf.decode_ms(batch))
    engine.decode_ms(batch)
    alone = statistics.median(engine.decode_ms(batch) for _ in range(reps))
    ratio = statistics.median(e / t for e, t in zip(ex, tr))
    return RunnerPoint(batch, context, statistics.median(ex), statistics.median(tr), ratio, alone)


# -- 2. roofline ---------------------------------------------------------------------------------------


def gemm_flops_per_s(size: int, reps: int) -> float:
    """Best of ``reps`` ``torch.mm`` of two ``size`` x ``size`` fp32 matrices, after one warm-up."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    torch.mm(a, b)
    best = min(_timed_mm(a, b) for _ in range(reps))
    return 2.0 * size**3 / best


def _timed_mm(a: torch.Tensor, b: torch.Tensor) -> float:
    t = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - t


def mean_output_context(workload: Workload) -> float:
    """The mean number of tokens an output token attends to: prompt + the tokens generated before it."""
    tokens = sum(r.output_len for r in workload.requests)
    total = sum(r.output_len * len(r.prompt_ids) + r.output_len * (r.output_len - 1) / 2 for r in workload.requests)
    return total / tokens if tokens else 0.0


def flops_per_token(model: torch.nn.Module, context: float) -> FlopsPerToken:
    """2 x matmul parameters + 2 x 2 x layers x context x hidden (see the module docstring)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied head is counted once, as the embedding
    matmul = total - embed.numel() + (head.numel() if head is embed else 0)
    c = model.config.get_text_config()
    attention = 2.0 * 2.0 * c.num_hidden_layers * context * c.hidden_size
    return FlopsPerToken(2.0 * matmul + attention, context, matmul, attention, c.num_hidden_layers, c.hidden_size)


def roofline_fraction(tokens_per_s: float | None, flops: float, gemm: float | None) -> float | None:
    if not tokens_per_s or not gemm:
        return None
    return tokens_per_s * flops / gemm


# -- 3. executor duty cycle in the real run ------------------------------------------------------------


def _step_walls(steps: list[dict[str, float]]) -> list[float]:
    """Each step's wall time in ms: the gap to the previous log line (the first: its own loop time)."""
    first = steps[0]["schedule_ms"] + steps[0]["redis_ms"] + steps[0]["executor_ms"]
    return [first] + [(b["t"] - a["t"]) * 1e3 for a, b in zip(steps, steps[1:])]


def busy_fraction(steps: list[dict[str, float]]) -> float | None:
    """sum(step_ms) over the wall time the step log spans (from the first step's start to the last's end)."""
    if not steps:
        return None
    wall = sum(_step_walls(steps))
    return sum(r["step_ms"] for r in steps) / wall if wall > 0 else None


def duty_by_running(steps: list[dict[str, float]]) -> list[DutyPoint]:
    """Duty cycle per number of running sequences: sum(step_ms) / sum(step wall time) over those steps."""
    buckets: dict[int, list[tuple[float, float]]] = {}
    for row, wall in zip(steps, _step_walls(steps) if steps else []):
        buckets.setdefault(int(row["running"]), []).append((row["step_ms"], wall))
    points = []
    for running, rows in sorted(buckets.items()):
        wall = sum(w for _, w in rows)
        if wall > 0:
            points.append(DutyPoint(running, len(rows), sum(s for s, _ in rows) / wall))
    return points


# -- the arm -------------------------------------------------------------------------------------------


def run(model_dir: Path, cfg: MachineConfig, workload: Workload, threads: int) -> MachineResult:
    from benchmarks.arm_hf import load_model

    torch.set_num_threads(threads)
    heap.keep_freed_memory()  # as the executor process does (both engines measured here share it)
    gemm = gemm_flops_per_s(cfg.gemm_size, cfg.gemm_reps)
    print(f"[machine] fp32 GEMM {cfg.gemm_size}^2: {gemm / 1e9:.1f} GFLOP/s", flush=True)
    model = load_model(model_dir, threads)
    flops = flops_per_token(model, mean_output_context(workload))
    hf = HFRunner(model, cfg)
    for b in cfg.batches:
        hf.prefill(b)
    engine = EngineRunner(model_dir, cfg, max(cfg.batches))
    points = []
    for b in cfg.batches:
        p = time_pairs(engine, hf, b, cfg.reps, cfg.context)
        print(
            f"[machine] batch {b}: executor {p.executor_ms:.1f} ms, transformers {p.transformers_ms:.1f} ms "
            f"({p.ratio:.3f}x)",
            flush=True,
        )
        points.append(p)
    return MachineResult(points, gemm, cfg.gemm_size, cfg.gemm_reps, flops, threads)


def summary_keys(
    result: MachineResult | None, tokens_per_s: dict[str, float], steps: list[dict[str, float]]
) -> dict[str, object]:
    """summary.json's "against the machine" keys; what was not measured in this run is null."""
    gemm = result.gemm_flops_per_s if result else None
    flops = result.flops.flops if result else 0.0
    return {
        "model_runner": [asdict(p) for p in result.runner] if result else [],
        "model_runner_ratio_32": result.ratio_at() if result else None,
        "gemm_flops_per_s": gemm,
        "gemm_size": result.gemm_size if result else None,
        "gemm_reps": result.gemm_reps if result else None,
        "model_flops_per_token": asdict(result.flops) if result else None,
        "roofline_fraction": roofline_fraction(tokens_per_s.get("pagedserve"), flops, gemm),
        "roofline_fraction_by_arm": {a: roofline_fraction(t, flops, gemm) for a, t in tokens_per_s.items()},
        "executor_busy_fraction": busy_fraction(steps),
        "duty_by_running": [asdict(p) for p in duty_by_running(steps)],
    }
