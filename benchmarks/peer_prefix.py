"""A prefix pulled from a peer's cache against the same prefix computed again, on real executors.

One deployment per mode (``--peer-prefix``, then ``--no-peer-prefix``): Redis, two executors with the
same KV budget, one scheduler (``benchmarks.stack``). Each trial uses a fresh ``prefix_len``-token
prefix (token ids, so no tokenizer is involved):

1. ``warm``: the prefix plus a few tokens, one output token: it lands on one executor (the
   *holder*), which then caches the prefix;
2. ``filler``: the prefix plus other tokens, greedy with ``ignore_eos``, long enough to outlast the
   probe (it is cancelled once the probe is done): prefix-aware placement puts it on the holder too, and
   it holds more than a quarter of the holder's pool while it decodes;
3. ``probe``: the prefix plus other tokens once the holder is busy: placement gives it to the other,
   idle executor. With ``--peer-prefix`` its loop asks the holder for the cached blocks and pulls them
   (when its measured costs say a pull is cheaper than the prefill: the first trial measures); without,
   it computes the whole prompt. Its **TTFT** (from the call to the first streamed token) is the figure.

Both modes see the same filler decoding on the same two cores while the probe is served, so the ratio
compares the pull with the prefill under the same contention. ``peer_prefix_ttft_ratio`` is the median
probe TTFT with the pull over the median without; the probes' tokens must agree between the modes.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from benchmarks.arm_pagedserve import request_pb
from benchmarks.config import kv_bytes_per_token
from benchmarks.stack import StackConfig, start
from benchmarks.workload import Vocab
from pagedserve.keys import Keys
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

NAMESPACE = "peer-prefix"
MODES = ("pull", "recompute")


@dataclass(frozen=True, slots=True)
class PeerPrefixConfig:
    trials: int = 3
    prefix_len: int = 1024
    suffix_len: int = 32  # the probe's own tokens after the prefix
    probe_tokens: int = 8
    kv_budget_tokens: int = 3072  # per executor: the filler's prefix alone is a third of it
    seed: int = 0


@dataclass(slots=True)
class ModeResult:
    mode: str
    ttft_ms: list[float] = field(default_factory=list)
    pulled_blocks: int = 0
    asks: int = 0
    on_other: int = 0  # probes served by the executor that did not hold the prefix

    @property
    def ttft_p50_ms(self) -> float | None:
        return statistics.median(self.ttft_ms) if self.ttft_ms else None

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "ttft_ms": self.ttft_ms,
            "ttft_p50_ms": self.ttft_p50_ms,
            "pulled_blocks": self.pulled_blocks,
            "asks": self.asks,
            "probes_on_the_other_executor": self.on_other,
        }


@dataclass(slots=True)
class PeerPrefixResult:
    modes: dict[str, ModeResult] = field(default_factory=dict)
    tokens_identical: bool | None = None

    def keys(self) -> dict[str, object]:
        pull, rc = self.modes.get("pull"), self.modes.get("recompute")
        ratio = None
        if pull and rc and pull.ttft_p50_ms is not None and rc.ttft_p50_ms:
            ratio = pull.ttft_p50_ms / rc.ttft_p50_ms
        return {
            "peer_prefix_ttft_ratio": ratio,
            "peer_prefix_ttft_ms_p50": pull.ttft_p50_ms if pull else None,
            "recompute_prefix_ttft_ms_p50": rc.ttft_p50_ms if rc else None,
            "peer_prefix_tokens_identical": self.tokens_identical,
        }


def _ids(rng: random.Random, vocab: Vocab, n: int) -> list[int]:
    return [rng.randrange(vocab.low, vocab.size) for _ in range(n)]


async def _stream(stub: pb_grpc.GenerationStub, req, tokens: list[int]) -> float:  # type: ignore[no-untyped-def]
    """Run ``req``; returns its TTFT in ms (the call to the first token)."""
    t0, first = time.perf_counter(), None
    async for resp in stub.Generate(req):
        if resp.token_ids and first is None:
            first = time.perf_counter()
        tokens.extend(resp.token_ids)
    return ((first or time.perf_counter()) - t0) * 1e3


async def _load(client: aioredis.Redis, keys: Keys, executor: str) -> float:
    v = json.loads(await client.hget(keys.usage, executor) or "{}")
    return 1 - v["free"][0] / v["blocks"][0] if v else 0.0


async def _mode(
    model_dir: Path, mode: str, cfg: PeerPrefixConfig, per_token: int, log_dir: Path
) -> tuple[ModeResult, list[list[int]]]:
    dep = start(
        model_dir,
        StackConfig(
            cfg.kv_budget_tokens * per_token,
            scheduler_args=("--peer-prefix" if mode == "pull" else "--no-peer-prefix",),
            executors=2,
            namespace=NAMESPACE,
        ),
        log_dir / mode,
    )
    keys = Keys(NAMESPACE)
    client = aioredis.from_url(dep.redis.url, decode_responses=True)
    out, probes = ModeResult(mode), []
    try:
        while await client.hlen(keys.usage) < 2:
            await asyncio.sleep(0.2)
        vocab = Vocab.from_model_dir(model_dir)
        rng = random.Random(cfg.seed)
        before = await client.hgetall(keys.counters)
        async with grpc.aio.insecure_channel(dep.scheduler.address, options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.GenerationStub(ch)
            for trial in range(cfg.trials):
                prefix = _ids(rng, vocab, cfg.prefix_len)
                await _stream(stub, request_pb(prefix + _ids(rng, vocab, 4), 1, f"warm-{trial}"), [])
                holder = await client.hget(keys.req(f"warm-{trial}"), "executor")
                long = cfg.kv_budget_tokens - cfg.prefix_len - 32  # all but two blocks of the holder's pool
                filler = asyncio.create_task(
                    _stream(stub, request_pb(prefix + _ids(rng, vocab, 8), long, f"fill-{trial}"), [])
                )
                others = [e for e in await client.hkeys(keys.usage) if e != holder]
                while await _load(client, keys, holder) <= 0.25 + max(
                    [await _load(client, keys, e) for e in others] or [0.0]
                ):
                    if filler.done():
                        raise RuntimeError("the filler ended before the holder got busy (a pool too large?)")
                    await asyncio.sleep(0.02)
                tokens: list[int] = []
                rid = f"probe-{trial}"
                suffix = _ids(rng, vocab, cfg.suffix_len)
                out.ttft_ms.append(await _stream(stub, request_pb(prefix + suffix, cfg.probe_tokens, rid), tokens))
                probes.append(tokens)
                out.on_other += (await client.hget(keys.req(rid), "executor")) != holder
                filler.cancel()  # the client leaves: the request is aborted and its blocks come free
                await asyncio.gather(filler, return_exceptions=True)
        after = await client.hgetall(keys.counters)
        out.pulled_blocks = int(after.get("prefix_blocks", 0)) - int(before.get("prefix_blocks", 0))
        out.asks = int(after.get("peer_prefix_asks", 0)) - int(before.get("peer_prefix_asks", 0))
        return out, probes
    finally:
        await client.aclose()
        dep.stop()


def run(model_dir: Path, cfg: PeerPrefixConfig, log_dir: Path) -> PeerPrefixResult:
    out = PeerPrefixResult()
    seen: list[list[list[int]]] = []
    for mode in MODES:
        result, tokens = asyncio.run(_mode(model_dir, mode, cfg, kv_bytes_per_token(model_dir), log_dir))
        out.modes[mode] = result
        seen.append(tokens)
    out.tokens_identical = seen[0] == seen[1] and all(len(t) == cfg.probe_tokens for t in seen[0])
    return out


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--logs", default="/tmp/pagedserve-peer-prefix")
    a = p.parse_args()
    r = run(Path(a.model), PeerPrefixConfig(a.trials, a.prefix_len), Path(a.logs))
    print(json.dumps({**r.keys(), "modes": {m: x.as_dict() for m, x in r.modes.items()}}, indent=2))


if __name__ == "__main__":
    main()
