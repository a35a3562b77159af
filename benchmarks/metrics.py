"""Per-request timings and the figures every arm reports, computed the same way for all arms.

Times are seconds on one clock whose zero is the start of the arm's run. TPOT
follows ``vllm bench serve``: (E2E - TTFT) / (output_len - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    index: int
    prompt_len: int
    output_len: int  # tokens actually received
    arrival: float
    first_token: float  # when its first output token became available
    end: float  # when the client had the whole answer
    token_times: list[float] = field(default_factory=list)  # one per received message (for ITL)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.end - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    a = np.asarray(values) * scale
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
    }


def concurrency(records: list[RequestRecord]) -> tuple[int, float]:
    """Peak and time-weighted mean of sequences in flight (first token .. end), over the whole run.

    One definition for every arm, from client-side timestamps only, so that
    pagedserve's step log and HF's internals need not agree on what "running" means.
    """
    events = sorted([(r.first_token, 1) for r in records] + [(r.end, -1) for r in records])
    if not events:
        return 0, 0.0
    start = min(r.arrival for r in records)
    stop = max(r.end for r in records)
    level = peak = 0
    area = 0.0
    last = start
    for t, d in events:
        area += level * (t - last)
        last = t
        level += d
        peak = max(peak, level)
    return peak, area / (stop - start) if stop > start else float(level)


def pooled(runs: list[tuple[list[RequestRecord], float]]) -> tuple[list[RequestRecord], float]:
    """Several runs of one workload as one: each run's times shifted past the runs before it (so that concurrency
    does not count two runs at once), durations added. ``summarize`` of the result weighs every run alike."""
    out: list[RequestRecord] = []
    offset = 0.0
    for records, duration in runs:
        out += [
            replace(
                r,
                arrival=r.arrival + offset,
                first_token=r.first_token + offset,
                end=r.end + offset,
                token_times=[t + offset for t in r.token_times],
            )
            for r in records
        ]
        offset += duration
    return out, offset


def summarize(records: list[RequestRecord], duration: float) -> dict[str, object]:
    out_tokens = sum(r.output_len for r in records)
    itl = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:])]
    peak, mean = concurrency(records)
    return {
        "num_requests": len(records),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "requests_per_s": len(records) / duration if duration > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft for r in records], 1e3),
        "tpot_ms": percentiles([t for r in records if (t := r.tpot) is not None], 1e3),
        "itl_ms": percentiles(itl, 1e3),
        # Streamed messages per token: below 1 where a server sent several steps' tokens in one message (ITL is
        # measured between messages, so those gaps span several steps).
        "messages_per_token": sum(len(r.token_times) for r in records) / out_tokens if out_tokens else 0.0,
        "e2e_ms": percentiles([r.e2e for r in records], 1e3),
        "peak_concurrent_seqs": peak,
        "mean_concurrent_seqs": mean,
    }
