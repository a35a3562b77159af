"""The shared-prefix arm: 64 requests behind one common 512-token system prompt.

Every request is the same system prompt followed by a short distinct question
and asks for a few tokens (``ignore_eos``), all sent at once. Three runs on
the same KV budget: pagedserve with prefix caching (its default), pagedserve
with ``--no-enable-prefix-caching``, and transformers' continuous batching
with ``allow_block_sharing`` (its prefix caching) on.

Prefill tokens computed come from pagedserve's step log: every scheduled
token is computed once, and of a request's ``output_len`` tokens all but the
last were fed back as decode tokens, so prefill = scheduled - sum(output_len - 1).

The caching-off run costs the most (every request prefills its 512-token
prompt: ~2.5 min on 2 cores), so the quick configuration skips it
(``measure_off`` False) and divides by the workload's prompt tokens instead:
caching off computes every prompt token at least once (more only when it
preempts for recompute), so that ratio can only overstate caching's share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.metrics import summarize
from benchmarks.stack import Stacks
from benchmarks.workload import Request, Vocab, Workload, WorkloadSpec

if TYPE_CHECKING:
    from benchmarks.arm_pagedserve import ServeConfig


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    num_requests: int = 64
    system_len: int = 512
    question_range: tuple[int, int] = (8, 24)
    output_len: int = 16  # short: the arm measures prefill reuse, and stays cheap in the quick run
    budget_tokens: int = 2048  # KV budget of every run (pagedserve's pool, transformers' blocks)
    seed: int = 0
    measure_off: bool = True  # run pagedserve with caching off too (else: its prompt tokens, a lower bound)
    max_model_len: int = 0  # the executors' --max-model-len if larger than the workload needs; it only caps admission

    def model_len(self) -> int:
        return max(self.max_model_len, self.system_len + self.question_range[1] + self.output_len + 16)

    def serve_config(self, per_token: int, caching: bool) -> ServeConfig:
        from benchmarks.arm_pagedserve import ServeConfig

        return ServeConfig(self.budget_tokens * per_token, max_model_len=self.model_len(), prefix_caching=caching)


@dataclass(slots=True)
class SharedPrefixResult:
    workload: Workload
    arms: dict[str, dict] = field(default_factory=dict)  # output tokens/s etc. per run
    prefill_tokens: dict[str, int] = field(default_factory=dict)  # pagedserve on / off
    off_source: str = "measured"  # or "prompt_tokens": caching off's count is the workload's prompt tokens
    errors: list[str] = field(default_factory=list)

    def ratio(self) -> float | None:
        on, hf = self.arms.get("pagedserve"), self.arms.get("hf_continuous_shared")
        return (
            on["output_tokens_per_s"] / hf["output_tokens_per_s"] if on and hf and hf["output_tokens_per_s"] else None
        )

    def prefill_ratio(self) -> float | None:
        on, off = self.prefill_tokens.get("pagedserve"), self.prefill_tokens.get("pagedserve_no_cache")
        return on / off if on is not None and off else None

    def as_dict(self) -> dict[str, object]:
        return {
            "workload": self.workload.describe(),
            "arms": self.arms,
            "prefill_tokens": self.prefill_tokens,
            "prefill_tokens_off_source": self.off_source,
            "throughput_ratio_vs_hf_continuous": self.ratio(),
            "prefill_tokens_ratio": self.prefill_ratio(),
        }


def make(cfg: SharedPrefixConfig, vocab: Vocab) -> Workload:
    rng = np.random.default_rng(cfg.seed)
    system = [int(t) for t in rng.integers(vocab.low, vocab.size, cfg.system_len)]
    lo, hi = cfg.question_range
    reqs = [
        Request(
            i,
            system + [int(t) for t in rng.integers(vocab.low, vocab.size, int(rng.integers(lo, hi + 1)))],
            cfg.output_len,
            0.0,
        )
        for i in range(cfg.num_requests)
    ]
    spec = WorkloadSpec(
        "shared_prefix",
        cfg.num_requests,
        1.0,
        (lo, hi),
        (cfg.output_len, cfg.output_len),
        cfg.system_len + hi + cfg.output_len,
        None,
        cfg.seed,
    )
    return Workload(spec, reqs)


def prefill_tokens(steps: list[dict[str, float]], workload: Workload) -> int:
    scheduled = int(sum(s["scheduled_tokens"] for s in steps))
    return scheduled - sum(r.output_len - 1 for r in workload.requests)


def serve(
    model_dir: Path, cfg: SharedPrefixConfig, per_token: int, log_dir: Path, stacks: Stacks
) -> SharedPrefixResult:
    """The pagedserve runs, on ``stacks``: a live deployment with the same flags serves them (the short run's, when
    both have one KV budget). ``hf_continuous`` adds transformers' run."""
    from benchmarks import arm_pagedserve

    workload = make(cfg, Vocab.from_model_dir(model_dir))
    out = SharedPrefixResult(workload)
    runs = (("pagedserve", True), ("pagedserve_no_cache", False)) if cfg.measure_off else (("pagedserve", True),)
    if not cfg.measure_off:
        out.off_source = "prompt_tokens"
        out.prefill_tokens["pagedserve_no_cache"] = sum(len(r.prompt_ids) for r in workload.requests)
    for name, caching in runs:
        scfg = cfg.serve_config(per_token, caching)
        deployment = stacks.get(arm_pagedserve.stack_config(scfg, log_dir / name / "steps.jsonl"), log_dir / name)
        res = arm_pagedserve.serve(deployment, workload)
        if res.failures:
            out.errors.append(f"shared_prefix {name}: {len(res.failures)} requests failed, e.g. {res.failures[0]}")
        out.arms[name] = summarize(res.records, res.duration)
        out.prefill_tokens[name] = prefill_tokens(res.steps, workload)
    return out


def hf_continuous(out: SharedPrefixResult, cfg: SharedPrefixConfig, model) -> None:  # noqa: ANN001
    """transformers' continuous batching with block sharing on the same workload and budget."""
    from benchmarks import arm_hf

    hres = arm_hf.run_continuous(model, out.workload, arm_hf.CBConfig(cfg.budget_tokens, allow_block_sharing=True))
    out.arms["hf_continuous_shared"] = summarize(hres.records, hres.duration)
