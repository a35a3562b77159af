"""KV blocks that move between executors (docs/architecture.md, "KV that moves").

Pull, not push: the loop of the executor that takes a request over (the
destination) allocates its blocks and puts a ``Pull`` in its step plan; this
executor then reads the blocks from the source executor's ``ReadBlocks`` and
writes them into its own pool while the plan's forward pass runs. The source
serves only blocks its own loop lent (``Lends``), so a block can never be read
after its loop reused it: a lend ends (``unlend``, or a plan that resets tables)
before any later plan of that loop runs, and every chunk is checked against the
lend when it is read.

Reads and lend changes both run on the executor's event loop and a chunk is
copied without awaiting, so a chunk is either read whole under its lend or
refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import torch

from executor_svc.kv_pool import KVPool
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
CHUNK_BYTES = 2 << 20  # K and V of a chunk together stay well under gRPC's 4 MiB message limit
PULL_TIMEOUT_S = 30.0
# A source that sends no chunk for this long is stuck (stopped, partitioned): the pull fails and its request
# recomputes, instead of holding the destination's step (and every request on it) for PULL_TIMEOUT_S.
CHUNK_TIMEOUT_S = 2.0

Ref = tuple[int, int]  # (tier, block)


class LendError(ValueError):
    """A read that this executor does not serve: FAILED_PRECONDITION, naming why."""


@dataclass(slots=True)
class Lends:
    """Blocks this executor's loop lent to readers: lend id -> its blocks."""

    held: dict[str, frozenset[Ref]] = field(default_factory=dict)

    def lend(self, lend_id: str, blocks: list[Ref]) -> None:
        self.held[lend_id] = frozenset(blocks)

    def unlend(self, lend_id: str) -> None:
        self.held.pop(lend_id, None)

    def clear(self) -> None:
        self.held.clear()

    def check(self, lend_id: str, blocks: list[Ref]) -> None:
        held = self.held.get(lend_id)
        if held is None:
            raise LendError(f"lend_id: {lend_id!r} is not lent here (ended, or its loop changed)")
        if not held.issuperset(blocks):
            raise LendError(f"blocks: not all lent under {lend_id!r}")

    def __bool__(self) -> bool:
        return bool(self.held)


def refs(blocks: list[pb.BlockRef]) -> list[Ref]:
    return [(int(b.tier), int(b.block)) for b in blocks]


def _per_chunk(pool: KVPool) -> int:
    return max(1, CHUNK_BYTES // pool.geometry.block_bytes)


def read_chunk(pool: KVPool, blocks: list[Ref], first: int, count: int) -> pb.BlockChunk:
    """Blocks ``[first, first + count)`` of ``blocks`` as one chunk (they may sit in several tiers)."""
    part = blocks[first : first + count]
    ks, vs = [], []
    for tier, block in part:
        t = pool.tier(tier)
        if block >= t.num_blocks:
            raise LendError(f"blocks: {block} is out of range for tier {tier}")
        ks.append(t.k[:, block])
        vs.append(t.v[:, block])
    k = torch.stack(ks, dim=1).cpu().contiguous()
    v = torch.stack(vs, dim=1).cpu().contiguous()
    return pb.BlockChunk(first=first, count=len(part), k=_bytes(k), v=_bytes(v))


async def chunks(
    pool: KVPool, blocks: list[Ref], still_lent: Callable[[], None], delay_s: float = 0.0
) -> AsyncIterator[pb.BlockChunk]:
    """Every block of ``blocks``, chunk by chunk, each read only after ``still_lent`` passed. ``delay_s``
    (``--read-blocks-delay-ms``, fault injection for tests): one block a chunk, each after that pause, so a
    test can kill the source or the reader mid-copy."""
    step = 1 if delay_s else _per_chunk(pool)
    for first in range(0, len(blocks), step):
        if delay_s:
            await asyncio.sleep(delay_s)
        still_lent()
        yield read_chunk(pool, blocks, first, step)


def _bytes(t: torch.Tensor) -> bytes:
    return t.view(torch.uint8).numpy().tobytes()


def write_chunk(pool: KVPool, dst: list[int], chunk: pb.BlockChunk) -> int:
    """Write a chunk into device blocks ``dst[first : first + count]``; returns its bytes."""
    g = pool.geometry
    ids = dst[chunk.first : chunk.first + chunk.count]
    if len(ids) != chunk.count or not ids:
        raise ValueError(f"chunk [{chunk.first}, +{chunk.count}) is outside the {len(dst)} blocks pulled")
    shape = (g.num_layers, chunk.count, g.block_size, g.num_kv_heads, g.head_dim)
    dev = pool.device
    index = torch.tensor(ids, dtype=torch.long, device=dev.k.device)
    for raw, target in ((chunk.k, dev.k), (chunk.v, dev.v)):
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        values = flat.view(g.dtype)
        if values.numel() != _numel(shape):
            raise ValueError(f"chunk of {values.numel()} values, expected {shape} (another model or block size?)")
        target.index_copy_(1, index, values.view(shape).to(target.device))
    return len(chunk.k) + len(chunk.v)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Puller:
    """This executor's client side: one channel per source address, dialled with the executor's
    own TLS files and internal token (``pagedserve.security.Dialer``)."""

    def __init__(self, dial: Callable[[str], grpc.aio.Channel], instance_id: Callable[[], str]) -> None:
        self.dial = dial
        self.instance_id = instance_id
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> pb_grpc.ExecutorStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.dial(address)
        return pb_grpc.ExecutorStub(ch)

    async def pull(self, pool: KVPool, p: pb.Pull) -> pb.PullResult:
        """Read ``p``'s blocks from its source into this pool; never raises (a failure is reported)."""
        t = time.perf_counter()
        moved, seen = 0, 0
        try:
            if len(p.src) != len(p.dst):
                raise ValueError(f"pull of {p.request_id}: {len(p.src)} source blocks, {len(p.dst)} destinations")
            call = self._stub(p.address).ReadBlocks(
                pb.ReadBlocksRequest(
                    instance_id=p.src_instance_id,
                    epoch=p.src_epoch,
                    lend_id=p.lend_id,
                    blocks=p.src,
                    reader_instance_id=self.instance_id(),
                ),
                timeout=PULL_TIMEOUT_S,
            )
            dst = list(p.dst)
            stream = call.__aiter__()
            while True:
                try:
                    chunk = await asyncio.wait_for(stream.__anext__(), CHUNK_TIMEOUT_S)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    call.cancel()
                    raise ValueError(f"no chunk from {p.address} in {CHUNK_TIMEOUT_S:.0f} s (stuck source?)") from None
                moved += write_chunk(pool, dst, chunk)
                seen += chunk.count
            if seen != len(dst):
                raise ValueError(f"{seen} of {len(dst)} blocks came")
        except grpc.aio.AioRpcError as exc:
            return self._failed(p, t, f"{exc.code().name}: {exc.details()}")
        except (ValueError, RuntimeError, OSError) as exc:
            return self._failed(p, t, str(exc))
        return pb.PullResult(request_id=p.request_id, ok=True, bytes=moved, ms=(time.perf_counter() - t) * 1000)

    @staticmethod
    def _failed(p: pb.Pull, t: float, why: str) -> pb.PullResult:
        log.warning("pull of %s from %s failed (%s); its scheduler recomputes it", p.request_id, p.address, why)
        return pb.PullResult(request_id=p.request_id, ok=False, error=why, ms=(time.perf_counter() - t) * 1000)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
