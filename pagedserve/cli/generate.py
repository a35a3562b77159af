"""``pagedserve generate``: stream a completion through the resuming client (``pagedserve.client``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

from pagedserve.client import generate
from pagedserve.v1 import generation_pb2 as pb


def _as_json(resp: pb.GenerateResponse) -> str:
    return json.dumps(
        {
            "request_id": resp.request_id,
            "index": resp.index,
            "offset": resp.offset,
            "token_ids": list(resp.token_ids),
            "text": resp.text,
            "finish_reason": resp.finish_reason,
        }
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="stream a completion to stdout")
    g.add_argument("prompt")
    g.add_argument(
        "--address",
        action="append",
        default=None,
        help="a scheduler replica HOST:PORT (repeatable: a broken stream resumes on the next; default localhost:50051)",
    )
    g.add_argument("--raw", action="store_true", help="plain completion instead of a chat message")
    g.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per response: request_id, index, offset, token_ids, text, finish_reason",
    )
    g.add_argument("--request-id", default="", help="default: a random one (needed to resume)")
    g.add_argument("-n", "--max-tokens", type=int, default=128)
    g.add_argument("-t", "--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--n",
        type=int,
        default=None,
        dest="completions",
        metavar="N",
        help="completions of the prompt (sampling.n); with more than one, each is printed when it ends",
    )
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--priority", type=int, default=0)
    g.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_API_KEY"),
        help="sent as authorization: Bearer KEY (default: $PAGEDSERVE_API_KEY)",
    )
    g.add_argument(
        "--tls-ca",
        default=None,
        metavar="PATH",
        help="speak TLS, trusting this CA bundle (PEM) for the scheduler's certificate",
    )


def request_of(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    for name in ("top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    if args.completions is not None:
        sampling.n = args.completions
    req = pb.GenerateRequest(request_id=args.request_id, sampling=sampling, priority=args.priority)
    if args.raw:
        req.prompt = args.prompt
    else:
        req.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    return req


def run(args: argparse.Namespace) -> int:
    texts: dict[int, str] = {}  # with --n above 1: each completion's text, printed when it ends
    try:
        for resp in generate(
            args.address or ["localhost:50051"], request_of(args), api_key=args.api_key, tls_ca=args.tls_ca
        ):
            if args.json:
                print(_as_json(resp), flush=True)
                continue
            if (args.completions or 1) > 1:
                texts[resp.index] = texts.get(resp.index, "") + resp.text
                if resp.finish_reason:
                    sys.stdout.write(f"[{resp.index}] {texts.pop(resp.index)}\n")
                    _usage(resp)
                continue
            sys.stdout.write(resp.text)
            sys.stdout.flush()
            if resp.finish_reason:
                sys.stdout.write("\n")
                _usage(resp)
    except grpc.RpcError as exc:
        sys.stderr.write(f"error: {exc.code().name}: {exc.details()}\n")
        return 1
    return 0


def _usage(resp: pb.GenerateResponse) -> None:
    sys.stdout.flush()
    sys.stderr.write(
        f"[{resp.finish_reason}: {resp.prompt_tokens} prompt + {resp.completion_tokens} completion tokens]\n"
    )
