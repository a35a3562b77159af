"""Seeded workloads: prompt/output lengths from a named distribution, random prompt ids, arrival times.

Every arm gets exactly the same token ids and output lengths (``ignore_eos``), so
throughput differences come from batching and memory management only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# ShareGPT as reported by the vLLM paper: mean 161 prompt and 338 output tokens, long-tailed.
SHAREGPT_MEAN_IN = 160.0
SHAREGPT_MEAN_OUT = 340.0
SHAREGPT_SIGMA_IN = 1.0
SHAREGPT_SIGMA_OUT = 0.8


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to generate. ``scale`` shrinks the ShareGPT means to fit a small machine."""

    distribution: str = "sharegpt"  # sharegpt | uniform
    num_requests: int = 64
    scale: float = 0.125
    input_range: tuple[int, int] = (8, 32)  # uniform only
    output_range: tuple[int, int] = (8, 64)  # uniform only
    max_total_len: int = 512  # prompt + output, clipped
    rate: float | None = None  # requests/s (Poisson); None: all at once
    seed: int = 0


@dataclass(slots=True)
class Request:
    index: int
    prompt_ids: list[int]
    output_len: int
    arrival: float  # seconds after the start of the run


@dataclass(slots=True)
class Workload:
    spec: WorkloadSpec
    requests: list[Request]

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> dict[str, object]:
        ins = [len(r.prompt_ids) for r in self.requests]
        outs = [r.output_len for r in self.requests]
        return {
            **{k: v for k, v in asdict(self.spec).items()},
            "prompt_len_mean": float(np.mean(ins)),
            "prompt_len_max": max(ins),
            "output_len_mean": float(np.mean(outs)),
            "output_len_max": max(outs),
            "total_prompt_tokens": sum(ins),
            "total_output_tokens": sum(outs),
        }


@dataclass(frozen=True, slots=True)
class Vocab:
    """Token ids safe to use as prompts: below ``size`` and above every special/added token."""

    low: int
    size: int

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Vocab:
        size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        low = 0
        tok = model_dir / "tokenizer.json"
        if tok.exists():
            added = json.loads(tok.read_text()).get("added_tokens", [])
            low = max((int(a["id"]) for a in added), default=-1) + 1
        return cls(min(low, size - 1), size)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # so that E[X] = mean
    return rng.lognormal(mu, sigma, n)


def lengths(spec: WorkloadSpec, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    n = spec.num_requests
    if spec.distribution == "sharegpt":
        ins = np.maximum(4, np.rint(_lognormal(rng, SHAREGPT_MEAN_IN * spec.scale, SHAREGPT_SIGMA_IN, n)))
        outs = np.maximum(2, np.rint(_lognormal(rng, SHAREGPT_MEAN_OUT * spec.scale, SHAREGPT_SIGMA_OUT, n)))
    elif spec.distribution == "uniform":
        ins = rng.integers(spec.input_range[0], spec.input_range[1] + 1, n)
        outs = rng.integers(spec.output_range[0], spec.output_range[1] + 1, n)
    else:
        raise ValueError(f"unknown distribution {spec.distribution!r} (sharegpt | uniform)")
    cap = spec.max_total_len
    ins = np.minimum(ins, cap // 2)
    outs = np.minimum(outs, cap - ins)
    return [int(x) for x in ins], [int(x) for x in outs]


def make_workload(spec: WorkloadSpec, vocab: Vocab) -> Workload:
    rng = np.random.default_rng(spec.seed)
    ins, outs = lengths(spec, rng)
    if spec.rate:
        arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, spec.num_requests))
        arrivals -= arrivals[0]
    else:
        arrivals = np.zeros(spec.num_requests)
    reqs = [
        Request(i, [int(t) for t in rng.integers(vocab.low, vocab.size, n_in)], n_out, float(a))
        for i, (n_in, n_out, a) in enumerate(zip(ins, outs, arrivals))
    ]
    return Workload(spec, reqs)
