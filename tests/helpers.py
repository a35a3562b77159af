"""Client-side helpers for tests: concurrent streams and Redis pool checks."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import redis

from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass(slots=True)
class Result:
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    request_id: str = ""
    chunks: int = 0

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def collect(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> Result:
    res = Result()
    async for resp in stub.Generate(req, timeout=300):
        res.request_id = resp.request_id
        res.token_ids += resp.token_ids
        res.texts.append(resp.text)
        res.chunks += 1
        if resp.finish_reason:
            res.finish_reason = resp.finish_reason
            res.prompt_tokens, res.completion_tokens = resp.prompt_tokens, resp.completion_tokens
    return res


def run_all(address: str, reqs: list[pb.GenerateRequest]) -> list[Result]:
    """Send every request at once on one channel; results in request order."""

    async def go() -> list[Result]:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            return await asyncio.gather(*(collect(stub, r) for r in reqs))

    return asyncio.run(go())


def greedy(ids: list[int], max_tokens: int, **kw: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    )


def pool_state(client: redis.Redis, namespace: str) -> tuple[list[int], list[int]]:
    """(free, total) block counts per tier as recorded in Redis."""
    p = "{" + namespace + "}:"
    totals = [int(x) for x in client.hget(p + "meta", "blocks").split(",")]
    free = [client.scard(f"{p}free:{t}") for t in range(3)]
    return free, totals


def wait_all_free(client: redis.Redis, namespace: str, timeout: float = 30) -> tuple[list[int], list[int]]:
    """Poll until no request is live and every block is free; returns the last state."""
    deadline = time.monotonic() + timeout
    while True:
        free, totals = pool_state(client, namespace)
        live = client.scard("{" + namespace + "}:live")
        if (free == totals and live == 0) or time.monotonic() > deadline:
            return free, totals
        time.sleep(0.1)
