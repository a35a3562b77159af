"""One client for every server's OpenAI door: ``/v1/completions`` with token-id prompts, ``ignore_eos``, streamed.

pagedserve's HTTP door and vLLM's OpenAI server are driven by this same code on the same workload, so their
figures differ by the server only. Each SSE chunk that carries text is one arrival (ITL is measured between
chunks, as ``vllm bench serve`` does); the token count is the usage the last chunk reports
(``stream_options.include_usage``), or the chunks' count where a server sends none.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from benchmarks.metrics import RequestRecord
from benchmarks.workload import Request, Workload


def body(model: str, req: Request) -> dict[str, object]:
    return {
        "model": model,
        "prompt": req.prompt_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one(
    http: httpx.AsyncClient, model: str, req: Request, t0: float, failures: list[str]
) -> RequestRecord | None:
    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    arrival = time.perf_counter() - t0
    times: list[float] = []
    tokens = 0
    try:
        async with http.stream("POST", "/v1/completions", json=body(model, req)) as resp:
            if resp.status_code != 200:
                failures.append(f"request {req.index}: HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter() - t0)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        failures.append(f"request {req.index}: {type(exc).__name__}: {exc}")
        return None
    if not times:
        failures.append(f"request {req.index}: no tokens")
        return None
    return RequestRecord(req.index, len(req.prompt_ids), tokens or len(times), arrival, times[0], times[-1], times)


async def drive(base_url: str, model: str, workload: Workload) -> tuple[list[RequestRecord], float, list[str]]:
    """Every request of ``workload`` at its arrival time, after one short warm-up request; records, duration and
    failures."""
    failures: list[str] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        warm = Request(-1, workload.requests[0].prompt_ids[:8], 4, 0.0)
        await _one(http, model, warm, time.perf_counter(), failures)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(_one(http, model, r, t0, failures) for r in workload.requests))
        duration = time.perf_counter() - t0
    return [r for r in done if r is not None], duration, failures


def run(base_url: str, model: str, workload: Workload) -> tuple[list[RequestRecord], float, list[str]]:
    return asyncio.run(drive(base_url, model, workload))
