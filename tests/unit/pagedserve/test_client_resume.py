"""The resuming client against a scripted Generation server (real gRPC over a socket, in this process).

What this isolates: the client's reconnection logic, with failures placed exactly where a real stack
places them only by chance. The server here is a script, not pagedserve: a real replica aborts a
completion whose stream its client cancels, so a client that cancels a healthy stream because a
sibling's failed loses that completion's tail (``make chaos`` found 3 such truncated ``n=2`` answers
in 4,000 requests). This script records cancellations instead of aborting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

from pagedserve import client as lib
from pagedserve.rpc import free_port
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

TOKENS = {0: [10, 11, 12, 13], 1: [20, 21, 22, 23]}


def _msg(index: int, offset: int, end: int | None = None) -> pb.GenerateResponse:
    tokens = TOKENS[index][offset:end]
    done = end is None or end >= len(TOKENS[index])
    return pb.GenerateResponse(
        request_id="g", index=index, offset=offset, token_ids=tokens, finish_reason="length" if done else ""
    )


class Script(pb_grpc.GenerationServicer):
    """Generate sends each completion's first token, then fails (a replica going away). Resume of completion 1
    fails once more, quickly; Resume of completion 0 is slow and healthy: it must never be cancelled."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []
        self.resumes: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        yield _msg(0, 0, 1)
        yield _msg(1, 0, 1)
        context.abort(grpc.StatusCode.UNAVAILABLE, "replica draining")

    def Resume(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        with self.lock:
            self.resumes.append((request.index, request.offset))
            first_of_1 = request.index == 1 and sum(1 for i, _ in self.resumes if i == 1) == 1
        if first_of_1:
            time.sleep(0.2)  # completion 0's stream is open by now
            context.abort(grpc.StatusCode.UNAVAILABLE, "a Redis outage detached this stream")
        if request.index == 0:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                if not context.is_active():
                    with self.lock:
                        self.cancelled.append(request.index)
                    return
                time.sleep(0.02)
        yield _msg(request.index, request.offset)


def test_one_completions_failure_never_cancels_anothers_stream() -> None:
    script = Script()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_GenerationServicer_to_server(script, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        req = pb.GenerateRequest(request_id="g", prompt_token_ids=[1], sampling=pb.SamplingParams(n=2))
        got: dict[int, list[int]] = {0: [], 1: []}
        for resp in lib.generate(f"127.0.0.1:{port}", req, timeout=30):
            assert resp.offset == len(got[resp.index])
            got[resp.index] += resp.token_ids
    finally:
        server.stop(0)
    assert got == TOKENS
    assert script.cancelled == [], "a healthy completion's stream was cancelled (the server would abort it)"
    assert (1, 1) in script.resumes and script.resumes.count((1, 1)) == 2, "completion 1 resumed again on its own"
