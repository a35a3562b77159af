"""``pagedserve generate``: call the public API from the command line.

    pagedserve generate "Write a haiku about paging"            # chat prompt
    pagedserve generate --raw "The capital of France is" -n 8   # plain completion
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import TextIO

import grpc

from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc


def generate(address: str, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
    """Stream the responses of one Generate call."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        yield from pb_grpc.GenerationStub(channel).Generate(request, timeout=timeout)


def stream_chat(address: str, prompt: str, out: TextIO, max_tokens: int = 128) -> pb.GenerateResponse:
    req = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=prompt)],
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    last = pb.GenerateResponse()
    for last in generate(address, req):
        out.write(last.text)
        out.flush()
    return last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve", description="Client for a pagedserve deployment.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion to stdout")
    g.add_argument("prompt")
    g.add_argument("--address", default="localhost:50051")
    g.add_argument("--raw", action="store_true", help="plain completion instead of a chat message")
    g.add_argument("-n", "--max-tokens", type=int, default=128)
    g.add_argument("-t", "--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--priority", type=int, default=0)
    args = p.parse_args(argv)
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    for name in ("top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    req = pb.GenerateRequest(sampling=sampling, priority=args.priority)
    if args.raw:
        req.prompt = args.prompt
    else:
        req.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    try:
        for resp in generate(args.address, req):
            sys.stdout.write(resp.text)
            sys.stdout.flush()
            if resp.finish_reason:
                sys.stdout.write("\n")
                sys.stderr.write(f"[{resp.finish_reason}: {resp.prompt_tokens} prompt + "
                                 f"{resp.completion_tokens} completion tokens]\n")
    except grpc.RpcError as exc:
        sys.stderr.write(f"error: {exc.code().name}: {exc.details()}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
