"""A frontend's view of its namespace: what requests are checked against, the
tokenizer, and the truth its health check tells.

Every second (every 0.2 s until it has a tokenizer) it reads the membership from Redis. The replica reports
SERVING only while Redis answers and at least one compatible executor is
serving; the tokenizer comes once from the first executor's ``Info`` (a
scheduler holds no copy of the model).
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health
from transformers import TokenizersBackend

from pagedserve import rpc
from pagedserve.executor.v1 import executor_pb2 as epb
from pagedserve.executor.v1 import executor_pb2_grpc as epb_grpc
from pagedserve.members import Member, Registry
from pagedserve.security import DialFn, insecure
from scheduler_svc.frontend.validate import Limits
from scheduler_svc.state.store import UNAVAILABLE

log = logging.getLogger(__name__)
INTERVAL_S = 1.0
STARTING_INTERVAL_S = 0.2  # until a tokenizer is loaded: a replica is ready soon after its first executor


def load_tokenizer(files: dict[str, bytes]) -> Any:
    """A tokenizer from the files an executor sent, as ``AutoTokenizer`` loads it.

    A ``tokenizer_config.json`` that names ``TokenizersBackend`` (SmolLM2's, and what transformers
    saves for most models since v5) without custom code is loaded with that class directly: it is
    the class ``AutoTokenizer`` picks then, and going through ``AutoTokenizer`` would import
    torch (via its config classes), which a scheduler has no other use for (~3 s at every start).
    """
    with tempfile.TemporaryDirectory(prefix="pagedserve-tok-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        config = json.loads(files.get("tokenizer_config.json", b"{}") or b"{}")
        if config.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in config:
            return TokenizersBackend.from_pretrained(tmp)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tmp)


def limits_of(members: list[Member], vocab_size: int, max_model_len: int = 0) -> Limits:
    """``max_model_len``: the scheduler's own cap (0: none). The limit stated (``Limits.max_model_len``,
    ``/v1/models``) is the longest request one pool can hold: per executor its context capped by its whole
    device pool (``executor_svc/context.py``: nothing is reserved for a request running alone), the largest
    over the executors."""
    cap = lambda n: min(max_model_len or n, n)  # noqa: E731
    pools = tuple((m.blocks[0], cap(m.max_model_len)) for m in members)
    block = members[0].block_size
    return Limits(max(min(n, b * block) for b, n in pools), vocab_size, block, pools)


class ClusterWatch:
    def __init__(self, registry: Registry, max_model_len: int = 0, dial: DialFn = insecure) -> None:
        self.registry = registry
        self.dial = dial
        self.max_model_len = max_model_len
        self.limits: Limits | None = None
        self.tokenizer: Any = None
        self.model = ""
        self.model_path = ""  # the model directory as the executor loaded it ("" from an older executor)
        self._vocab = 0
        self._serving: bool | None = None

    @property
    def serving(self) -> bool:
        """What the last refresh found: the tokenizer is loaded and an executor serves
        (what gRPC health says, read without a Redis round trip)."""
        return bool(self._serving)

    async def _info(self, members: list[Member]) -> None:
        for m in members:
            try:
                async with self.dial(m.address) as ch:
                    info = await epb_grpc.ExecutorStub(ch).Info(epb.InfoRequest(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                log.info("executor %s at %s: %s; trying another", m.instance_id, m.address, exc.code().name)
                continue
            self.tokenizer = await asyncio.to_thread(load_tokenizer, dict(info.tokenizer_files))
            self._vocab, self.model, self.model_path = info.vocab_size, info.model, info.model_path
            log.info("tokenizer of %s loaded from executor %s", info.model, m.address)
            return

    async def refresh(self) -> bool:
        """Read the membership once; returns whether this replica can serve."""
        try:
            view = await self.registry.read()
        except UNAVAILABLE as exc:
            log.warning("redis unavailable: %s", exc)
            return False
        members = view.compatible()
        if members and self.tokenizer is None:
            await self._info(members)
        if members and self.tokenizer is not None:
            self.limits = limits_of(members, self._vocab, self.max_model_len)
        return self.tokenizer is not None and any(m.serving for m in members)

    async def run(self, stop: asyncio.Event, health_servicer: health.HealthServicer, names: list[str]) -> None:
        while not stop.is_set():
            serving = await self.refresh()
            if serving != self._serving:
                log.info("health: %s", "SERVING" if serving else "NOT_SERVING (no serving executor, or no redis)")
                await rpc.set_serving(health_servicer, names, serving)
                self._serving = serving
            try:
                await asyncio.wait_for(stop.wait(), INTERVAL_S if self.tokenizer is not None else STARTING_INTERVAL_S)
            except TimeoutError:
                pass
