"""Traces and structured logs.

One trace per request across the frontend and the loop of the executor it ran
on, exported by the OpenTelemetry SDK's in-memory exporter: the frontend's and
the loop's real code run in this process against a real redis-server; the
executor is a stub that returns token 7 for each sampled sequence (it isolates
what is traced from the model).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import redis.asyncio as aioredis
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from transformers import AutoTokenizer

from pagedserve import logs, tracing
from pagedserve.executor.v1 import executor_pb2 as epb
from pagedserve.members import Member, Registry
from scheduler_svc.core.request import Params, Request
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.frontend.bus import EventBus
from scheduler_svc.frontend.service import Frontend
from scheduler_svc.frontend.validate import Limits
from scheduler_svc.frontend.watch import ClusterWatch
from scheduler_svc.loops.loop import Loop
from scheduler_svc.state.store import RedisStore
from tests.test_state_property import EchoExecutor


async def _traced_request(redis_url: str, tokenizer_dir: Path, front: tracing.Tracing, loops: tracing.Tracing) -> str:
    client = aioredis.from_url(redis_url, decode_responses=True)
    store = RedisStore(client, "traced")
    watch = ClusterWatch(Registry(client, store.keys))
    watch.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    watch.limits, watch.model = Limits(64, 49152, 4, ((16, 64),)), "tiny"
    bus = EventBus(store)
    frontend = Frontend(store, bus, watch, tracer=front.tracer)
    info = epb.InfoResponse(
        instance_id="exec-t", model="tiny", block_size=4, num_gpu_blocks=16, max_model_len=64, eos_token_ids=[2]
    )
    member = Member("exec-t", "stub", "tiny", "d", "float32", 4, (16, 0, 0), 64)
    epoch = await store.acquire("exec-t", "test", 60_000)
    loop = Loop(
        store, info, EchoExecutor(info), SchedulerConfig(max_model_len=64), epoch, lambda: member, tracer=loops.tracer
    )
    loop.idle_block_ms = 50
    await loop.start()
    stop = asyncio.Event()

    async def step() -> None:
        while not stop.is_set():
            await loop.iterate()

    tasks = [asyncio.create_task(bus.run(stop)), asyncio.create_task(step())]
    await asyncio.sleep(0.2)  # the bus reads from the stream's tail on
    chunks = [c async for c in frontend.generate(Request("traced-1", [5, 6, 7], Params(max_tokens=4)), [])]
    stop.set()
    await asyncio.gather(*tasks)
    await client.aclose()
    return chunks[-1].finish_reason


def test_one_trace_per_request_across_frontend_and_loop(redis_url: str, tiny_llama: Path) -> None:
    front_spans, loop_spans = InMemorySpanExporter(), InMemorySpanExporter()
    front, loops = tracing.setup("frontend", exporter=front_spans), tracing.setup("loop", exporter=loop_spans)
    assert front is not None and loops is not None
    assert asyncio.run(_traced_request(redis_url, tiny_llama, front, loops)) == "length"
    front.shutdown()
    loops.shutdown()
    (root,) = front_spans.get_finished_spans()
    assert root.name == "pagedserve.request" and root.attributes["pagedserve.request_id"] == "traced-1"
    assert root.attributes["pagedserve.completion_tokens"] == 4
    spans = {s.name: s for s in loop_spans.get_finished_spans()}
    assert set(spans) == {"pagedserve.queue", "pagedserve.executor"}
    for span in spans.values():
        assert span.context.trace_id == root.context.trace_id, "the same trace"
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert span.attributes["pagedserve.request_id"] == "traced-1"
        assert span.attributes["pagedserve.executor"] == "exec-t"
    ran = spans["pagedserve.executor"]
    assert ran.attributes["pagedserve.tokens"] == 4 and ran.attributes["pagedserve.finish_reason"] == "length"
    assert spans["pagedserve.queue"].end_time <= ran.start_time <= ran.end_time <= root.end_time


def test_tracing_is_off_without_an_endpoint() -> None:
    assert tracing.setup("x") is None


def test_json_logs_carry_request_and_executor() -> None:
    formatter = logs.JsonFormatter()
    logger = logs.for_executor(logging.getLogger("t"), "exec-1")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("t").addHandler(handler)
    logging.getLogger("t").setLevel(logging.INFO)
    try:
        logger.info("stepped %d", 3)
        logging.getLogger("t").warning("lost", extra={"request_id": "r1"})
    finally:
        logging.getLogger("t").removeHandler(handler)
    first, second = (json.loads(formatter.format(r)) for r in records)
    assert first["message"] == "stepped 3" and first["executor"] == "exec-1" and "request_id" not in first
    assert second["request_id"] == "r1" and second["level"] == "WARNING" and second["logger"] == "t"
