"""What a JSON-schema constraint costs: output tokens/s constrained vs plain greedy, in one run.

One deployment (Redis, scheduler, one SmolLM2 executor; the logprobs arm's too), ``requests`` chat requests at
once, greedy, in rounds that alternate plain and constrained batches (plain, json, plain, json...):
- **plain**: ``ignore_eos``, ``max_tokens`` = ``plain_tokens`` (every output the same length);
- **json**: a JSON schema whose outputs have an almost fixed length (an array of exactly
  ``items`` enum strings), so both batches run about as many steps at the same batch size and
  their tokens/s compare the per-step cost, mask included.
The headline ratio compares steps, not wall times, since the machine's load drifts: from the
scheduler's step log, the median interval between consecutive decode steps that ran the whole
batch (every request running, one token each), plain over json: the tokens/s of a full batch
(the executor's step with the mask applied, the RPC, the loop's commit). The wall ratio (output
tokens over each batch's wall time, the median over rounds of json / plain against the plain
batch just before it) is kept beside it. Every constrained output is checked against the schema
(``valid``).

The mask time per step per constrained sequence is measured here, in this process, as the
executor spends it: the constrained outputs' tokens replayed through an xgrammar matcher (the
executor's compiler, SmolLM2's tokenizer), timing ``fill_next_token_bitmask`` per token
(the executor runs it in a worker thread while the forward pass runs) and the batch's
``apply_token_bitmask_inplace`` on float32 logits (on the critical path).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import jsonschema
import torch

from benchmarks.stack import Stack, read_log
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

WORDS = ["alpha", "beta", "gamma", "delta"]
TOPICS = ["colours", "animals", "cities", "rivers", "tools", "fruits", "planets", "songs"]


@dataclass(slots=True)
class StructuredConfig:
    requests: int = 8
    rounds: int = 3
    items: int = 6  # array items of the schema: ~5 tokens each, ~35 tokens in all
    plain_tokens: int = 34


@dataclass(slots=True)
class StructuredResult:
    plain_tokens_per_s: float
    json_tokens_per_s: float
    ratio: float  # json / plain tokens/s of a full batch: median decode-step interval, plain over json
    wall_ratio: float  # json / plain tokens/s over each batch's wall time, median of the per-round ratios
    plain_step_ms: float = 0.0  # median interval between full-batch decode steps
    json_step_ms: float = 0.0
    rounds: list[dict[str, float]] = field(default_factory=list)
    valid: int = 0  # constrained outputs that parse and validate
    constrained: int = 0
    mean_json_tokens: float = 0.0
    mask_fill_ms_per_token: float = 0.0  # median over every replayed token (worker thread, overlapped)
    mask_fill_ms_p99: float = 0.0
    mask_apply_ms_per_step: float = 0.0  # one apply over a batch of `requests` rows (critical path)
    compile_ms: float = 0.0  # the schema's first compile (then cached)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def schema(items: int) -> dict[str, object]:
    return {
        "type": "object",
        "properties": {"words": {"type": "array", "items": {"enum": WORDS}, "minItems": items, "maxItems": items}},
        "required": ["words"],
        "additionalProperties": False,
    }


def _requests(cfg: StructuredConfig, constrained: bool) -> list[pb.GenerateRequest]:
    reqs = []
    for i in range(cfg.requests):
        text = f"List some {TOPICS[i % len(TOPICS)]} as JSON."
        s = pb.SamplingParams(temperature=0.0)
        if constrained:
            s.max_tokens = 8 * cfg.items + 16
            s.structured_output.json_schema = json.dumps(schema(cfg.items))
        else:
            s.max_tokens, s.ignore_eos = cfg.plain_tokens, True
        reqs.append(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)], sampling=s))
    return reqs


async def _one(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> tuple[list[int], str, str]:
    ids: list[int] = []
    text, reason = [], ""
    async for resp in stub.Generate(req, timeout=600):
        ids += resp.token_ids
        text.append(resp.text)
        reason = resp.finish_reason or reason
    return ids, "".join(text), reason


async def _batch(address: str, reqs: list[pb.GenerateRequest]) -> tuple[float, list[tuple[list[int], str, str]]]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t = time.perf_counter()
        out = await asyncio.gather(*(_one(stub, r) for r in reqs))
        return time.perf_counter() - t, list(out)


def _timed(
    address: str, reqs: list[pb.GenerateRequest]
) -> tuple[float, list[tuple[list[int], str, str]], tuple[float, float]]:
    t0 = time.time()
    wall, out = asyncio.run(_batch(address, reqs))
    return wall, out, (t0, time.time())


def step_interval_ms(steps: list[dict[str, float]], window: tuple[float, float], batch: int) -> float:
    """Median ms between consecutive decode steps of the whole batch within ``window`` (wall clock)."""
    rows = [r for r in steps if window[0] <= r["t"] <= window[1]]
    gaps = [
        (b["t"] - a["t"]) * 1e3
        for a, b in zip(rows, rows[1:])
        if a["running"] == b["running"] == b["scheduled_tokens"] == batch
    ]
    return statistics.median(gaps) if gaps else float("nan")


def mask_times(model_dir: Path, spec: str, outputs: list[list[int]], batch: int) -> tuple[float, float, float, float]:
    """(fill median ms, fill p99 ms, apply ms for ``batch`` rows, first compile ms) on the outputs' tokens."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagedserve.grammar import Compiler

    config = json.loads((model_dir / "config.json").read_text())
    vocab, eos = int(config["vocab_size"]), config.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else None
    compiler = Compiler(AutoTokenizer.from_pretrained(model_dir), vocab, eos)
    t = time.perf_counter()
    compiler.compile(("json_schema", spec))
    compile_ms = (time.perf_counter() - t) * 1e3
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    fills: list[float] = []
    for out in outputs:
        m = compiler.matcher(("json_schema", spec))
        for tok in out:
            if m.is_terminated():
                break
            t = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            fills.append((time.perf_counter() - t) * 1e3)
            if not m.accept_token(tok):
                break
    logits = torch.randn(batch, vocab)
    applies = []
    for _ in range(21):
        t = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=list(range(batch)))
        applies.append((time.perf_counter() - t) * 1e3)
    fills.sort()
    return (statistics.median(fills), fills[int(0.99 * (len(fills) - 1))], statistics.median(applies[1:]), compile_ms)


def run(model_dir: Path, deployment: Stack, cfg: StructuredConfig) -> StructuredResult:
    """On a live deployment with a step log (``--step-log``) that admits ``cfg.requests`` at once."""
    plain, constrained = _requests(cfg, False), _requests(cfg, True)
    spec = constrained[0].sampling.structured_output.json_schema
    rounds: list[dict[str, float]] = []
    outputs: list[list[int]] = []
    valid = count = 0
    step_log = deployment.config.step_log
    if step_log is None:
        raise ValueError("the structured arm reads the scheduler's step log: its deployment needs one")
    windows: list[tuple[tuple[float, float], tuple[float, float]]] = []
    address = deployment.address
    asyncio.run(_batch(address, [plain[0], constrained[0]]))  # warm-up: compile, executor's tokenizer
    for _ in range(cfg.rounds):
        pw, pout, pwin = _timed(address, plain)
        jw, jout, jwin = _timed(address, constrained)
        windows.append((pwin, jwin))
        ptoks, jtoks = sum(len(o[0]) for o in pout), sum(len(o[0]) for o in jout)
        rounds.append(
            {
                "plain_tokens": ptoks,
                "plain_s": pw,
                "json_tokens": jtoks,
                "json_s": jw,
                "ratio": (jtoks / jw) / (ptoks / pw),
            }
        )
        for ids, text, reason in jout:
            count += 1
            outputs.append(ids)
            try:
                jsonschema.validate(json.loads(text), json.loads(spec))
                valid += reason == "stop"
            except (ValueError, jsonschema.ValidationError):
                pass
    fill, fill99, apply, compile_ms = mask_times(model_dir, spec, outputs[: cfg.requests], cfg.requests)
    ptps = sum(r["plain_tokens"] for r in rounds) / sum(r["plain_s"] for r in rounds)
    jtps = sum(r["json_tokens"] for r in rounds) / sum(r["json_s"] for r in rounds)
    steps = read_log(step_log)  # the deployment is live: its loop may be appending a line
    pstep = statistics.median(step_interval_ms(steps, p, cfg.requests) for p, _ in windows)
    jstep = statistics.median(step_interval_ms(steps, j, cfg.requests) for _, j in windows)
    result = StructuredResult(
        ptps,
        jtps,
        pstep / jstep,
        statistics.median(r["ratio"] for r in rounds),
        pstep,
        jstep,
        rounds,
        valid,
        count,
        statistics.mean(len(o) for o in outputs),
        fill,
        fill99,
        apply,
        compile_ms,
    )
    print(
        f"[structured] full-batch step {pstep:.1f} ms plain, {jstep:.1f} ms json schema (tokens/s ratio "
        f"{result.ratio:.3f}); wall: plain {ptps:.1f} tok/s, json {jtps:.1f} (ratio {result.wall_ratio:.3f}); "
        f"{valid}/{count} valid; mask fill {fill * 1e3:.1f} us/token (p99 {fill99 * 1e3:.1f} us), apply "
        f"{apply:.3f} ms per step of {cfg.requests}",
        flush=True,
    )
    return result
