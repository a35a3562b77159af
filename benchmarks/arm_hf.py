"""Arms 2 and 3: Hugging Face transformers in this process, static batching and continuous batching.

Both get the same KV budget as pagedserve, expressed in tokens (budget bytes /
KV bytes per token), and the same torch thread count.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.metrics import RequestRecord
from benchmarks.workload import Request, Workload


@dataclass(slots=True)
class Batch:
    requests: list[Request]

    @property
    def padded_prompt(self) -> int:
        return max(len(r.prompt_ids) for r in self.requests)

    @property
    def steps(self) -> int:
        return max(r.output_len for r in self.requests)

    @property
    def reserved_tokens(self) -> int:
        """What static allocation holds for this batch: every row as long as the longest prompt + longest output."""
        return len(self.requests) * (self.padded_prompt + self.steps)


@dataclass(slots=True)
class HFResult:
    records: list[RequestRecord]
    duration: float
    batches: list[Batch] = field(default_factory=list)
    batch_times: list[tuple[float, float]] = field(default_factory=list)  # (start, end) per static batch


def fits(batch: list[Request], nxt: Request, budget_tokens: int) -> bool:
    rows = [*batch, nxt]
    longest = max(len(r.prompt_ids) for r in rows) + max(r.output_len for r in rows)
    return longest * len(rows) <= budget_tokens


def pack(pending: list[Request], budget_tokens: int) -> tuple[Batch, list[Request]]:
    """vLLM's HF throughput baseline: take requests in order while the padded batch fits the budget.

    A first request that alone exceeds the budget still runs alone (it has to run somewhere).
    """
    batch = [pending[0]]
    i = 1
    while i < len(pending) and fits(batch, pending[i], budget_tokens):
        batch.append(pending[i])
        i += 1
    return Batch(batch), pending[i:]


def load_model(model_dir: Path, threads: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class _StepClock:
    """A generate() streamer that only records when each decoding step's tokens appear."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter() - self.t0)
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _generate(model: torch.nn.Module, batch: Batch, pad_id: int, clock: _StepClock | None) -> None:
    width = batch.padded_prompt
    ids = torch.full((len(batch.requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch.requests):
        ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids) :] = 1
    n = batch.steps
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=clock,
        )


def run_static(model: torch.nn.Module, workload: Workload, budget_tokens: int) -> HFResult:
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    _generate(model, Batch([Request(-1, workload.requests[0].prompt_ids[:8], 4, 0.0)]), pad_id, None)
    pending = sorted(workload.requests, key=lambda r: r.arrival)
    records: list[RequestRecord] = []
    result = HFResult(records, 0.0)
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        if pending[0].arrival > now:
            time.sleep(pending[0].arrival - now)
            now = pending[0].arrival
        arrived = [r for r in pending if r.arrival <= now]
        batch, rest = pack(arrived, budget_tokens)
        pending = rest + pending[len(arrived) :]
        clock = _StepClock(t0)
        start = time.perf_counter() - t0
        _generate(model, batch, pad_id, clock)
        end = time.perf_counter() - t0
        result.batches.append(batch)
        result.batch_times.append((start, end))
        for r in batch.requests:
            # The answer reaches the caller when generate() returns, after the batch's longest output.
            times = clock.times[: r.output_len]
            records.append(RequestRecord(r.index, len(r.prompt_ids), r.output_len, r.arrival, times[0], end, times))
    result.duration = time.perf_counter() - t0
    return result


@dataclass(frozen=True, slots=True)
class CBConfig:
    budget_tokens: int
    block_size: int = 16
    max_batch_tokens: int = 2048
    max_requests_per_batch: int = 256
    allow_block_sharing: bool = False  # transformers' prefix caching (the shared-prefix arm turns it on)


def run_continuous(model: torch.nn.Module, workload: Workload, cfg: CBConfig) -> HFResult:
    """transformers' continuous batching manager (what ``generate_batch`` uses), with per-request lengths.

    ``generate_batch`` takes one ``max_new_tokens`` for all prompts; the manager it
    wraps takes one per request and lets requests arrive over time.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    reqs = sorted(workload.requests, key=lambda r: r.arrival)
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.output_len for r in reqs),
        eos_token_id=-1,
        pad_token_id=model.config.pad_token_id,
    )
    cb = ContinuousBatchingConfig(
        page_size=cfg.block_size,
        num_blocks=max(1, cfg.budget_tokens // cfg.block_size),
        max_batch_tokens=cfg.max_batch_tokens,
        max_requests_per_batch=cfg.max_requests_per_batch,
        allow_block_sharing=cfg.allow_block_sharing,
    )
    hints = WorkloadHints(max(len(r.prompt_ids) for r in reqs), gen.max_new_tokens, len(reqs))
    arrivals: dict[str, float] = {}
    records: list[RequestRecord] = []
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, workload_hints=hints
    ) as manager:
        manager.add_request(reqs[0].prompt_ids[:8], request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        while (warm := manager.get_result(timeout=60)) is None or not warm.is_finished():
            pass
        t0 = time.perf_counter()

        def feed() -> None:
            for r in reqs:
                delay = t0 + r.arrival - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                arrivals[f"r{r.index}"] = time.perf_counter() - t0
                manager.add_request(
                    r.prompt_ids,
                    request_id=f"r{r.index}",
                    max_new_tokens=r.output_len,
                    record_timestamps=True,
                    eos_token_id=-1,
                )

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        by_id = {f"r{r.index}": r for r in reqs}
        while len(records) < len(reqs):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                continue
            if not out.is_finished() or out.request_id not in by_id:
                continue
            if out.error is not None:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            r = by_id[out.request_id]
            times = [t - t0 for t in out.timestamps or []]
            end = out.lifespan[1] - t0 if out.lifespan[1] > 0 else time.perf_counter() - t0
            records.append(
                RequestRecord(
                    r.index,
                    len(r.prompt_ids),
                    len(out.generated_tokens),
                    arrivals[out.request_id],
                    times[0] if times else end,
                    end,
                    times,
                )
            )
        duration = time.perf_counter() - t0
        feeder.join()
    return HFResult(sorted(records, key=lambda x: x.index), duration)
