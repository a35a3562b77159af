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

import numpy as np

from benchmarks.metrics import summarize
from benchmarks.workload import Request, Vocab, Workload, WorkloadSpec


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    num_requests: int = 64
    system_len: int = 512
    question_range: tuple[int, int] = (8, 24)
    output_len: int = 16  # short: the arm measures prefill reuse, and stays cheap in the quick run
    budget_tokens: int = 2048  # KV budget of every run (pagedserve's pool, transformers' blocks)
    seed: int = 0
    measure_off: bool = True  # run pagedserve with caching off too (else: its prompt tokens, a lower bound)


@dataclass(slots=True)
class SharedPrefixResult:
    workload: Workload
    arms: dict[str, dict] = field(default_factory=dict)  # output tokens/s etc. per run
    prefill_tokens: dict[str, int] = field(default_factory=dict)  # pagedserve on / off
    off_source: str = "measured"  # or "prompt_tokens": caching off's count is the workload's prompt tokens
    errors: list[str] = field(default_factory=list)

    def ratio(self) -> float | None:
        on, hf = self.arms.get("pagedserve"), self.arms.get("hf_continuous_shared")
        return on["output_tokens_per_s"] / hf["output_tokens_per_s"] if on and hf and hf["output_tokens_per_s"] \
            else None

    def prefill_ratio(self) -> float | None:
        on, off = self.prefill_tokens.get("pagedserve"), self.prefill_tokens.get("pagedserve_no_cache")
        return on / off if on is not None and off else None

    def as_dict(self) -> dict[str, object]:
        return {"workload": self.workload.describe(), "arms": self.arms, "prefill_tokens": self.prefill_tokens,
                "prefill_tokens_off_source": self.off_source,
                "throughput_ratio_vs_hf_continuous": self.ratio(), "prefill_tokens_ratio": self.prefill_ratio()}


def make(cfg: SharedPrefixConfig, vocab: Vocab) -> Workload:
    rng = np.random.default_rng(cfg.seed)
    system = [int(t) for t in rng.integers(vocab.low, vocab.size, cfg.system_len)]
    lo, hi = cfg.question_range
    reqs = [Request(i, system + [int(t) for t in rng.integers(vocab.low, vocab.size, int(rng.integers(lo, hi + 1)))],
                    cfg.output_len, 0.0) for i in range(cfg.num_requests)]
    spec = WorkloadSpec("shared_prefix", cfg.num_requests, 1.0, (lo, hi), (cfg.output_len, cfg.output_len),
                        cfg.system_len + hi + cfg.output_len, None, cfg.seed)
    return Workload(spec, reqs)


def prefill_tokens(steps: list[dict[str, float]], workload: Workload) -> int:
    scheduled = int(sum(s["scheduled_tokens"] for s in steps))
    return scheduled - sum(r.output_len - 1 for r in workload.requests)


def run(model_dir: Path, cfg: SharedPrefixConfig, per_token: int, log_dir: Path, hf_model=None,  # noqa: ANN001
        threads: int = 2) -> SharedPrefixResult:
    from benchmarks import arm_hf, arm_pagedserve

    workload = make(cfg, Vocab.from_model_dir(model_dir))
    out = SharedPrefixResult(workload)
    max_len = cfg.system_len + cfg.question_range[1] + cfg.output_len + 16
    runs = (("pagedserve", True), ("pagedserve_no_cache", False)) if cfg.measure_off else (("pagedserve", True),)
    if not cfg.measure_off:
        out.off_source = "prompt_tokens"
        out.prefill_tokens["pagedserve_no_cache"] = sum(len(r.prompt_ids) for r in workload.requests)
    for name, caching in runs:
        scfg = arm_pagedserve.ServeConfig(cfg.budget_tokens * per_token, max_model_len=max_len, prefix_caching=caching)
        res = arm_pagedserve.run(model_dir, workload, scfg, log_dir / name)
        if res.failures:
            out.errors.append(f"shared_prefix {name}: {len(res.failures)} requests failed, e.g. {res.failures[0]}")
        out.arms[name] = summarize(res.records, res.duration)
        out.prefill_tokens[name] = prefill_tokens(res.steps, workload)
    model = hf_model if hf_model is not None else arm_hf.load_model(model_dir, threads)
    hres = arm_hf.run_continuous(model, workload, arm_hf.CBConfig(cfg.budget_tokens, allow_block_sharing=True))
    out.arms["hf_continuous_shared"] = summarize(hres.records, hres.duration)
    return out
