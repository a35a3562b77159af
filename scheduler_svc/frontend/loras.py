"""The namespace's LoRA adapters as the API sees them: registered in Redis, not per replica.

``{ns}:loras`` maps a name to the adapter's directory, digest and rank
(``pagedserve/lora.py``). Registering reads the directory here (its digest is the
adapter's identity, and a rank over ``--max-lora-rank`` is refused at once); every
replica then serves the name, and executors load the adapter on demand. A request's
adapter is looked up in Redis when it arrives, so a registration made on one replica
is seen by the next request on any other.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from pagedserve import lora
from pagedserve.keys import Keys
from scheduler_svc.frontend.refusals import InvalidArgument, Kind, Refusal

log = logging.getLogger(__name__)


class LoraDisabled(Refusal):
    def __init__(self, field: str) -> None:
        super().__init__(
            Kind.INVALID_ARGUMENT, "LoRA adapters are off on this server (start it with --enable-lora)", field
        )


def unknown(name: str, field: str) -> Refusal:
    """vLLM's answer to a model (or adapter) it does not serve: 404 ``model_not_found`` / NOT_FOUND."""
    return Refusal(Kind.MODEL_NOT_FOUND, f"The model `{name}` does not exist.", field)


class LoraRegistry:
    def __init__(self, client: aioredis.Redis, keys: Keys, enabled: bool = False, max_rank: int = 16) -> None:
        self.r = client
        self.key = keys.loras
        self.enabled = enabled  # --enable-lora
        self.max_rank = max_rank  # --max-lora-rank
        self.seen: dict[str, lora.Adapter] = {}  # names looked up lately (the tokenizer endpoints accept them)

    async def resolve(self, name: str, field: str = "lora_name") -> lora.Adapter:
        """The adapter registered as ``name`` now; a refusal naming it if there is none."""
        if not self.enabled:
            raise LoraDisabled(field)
        text = await self.r.hget(self.key, name)
        if text is None:
            self.seen.pop(name, None)
            raise unknown(name, field)
        adapter = lora.Adapter.from_json(name, text)
        self.seen[name] = adapter
        return adapter

    async def all(self) -> list[lora.Adapter]:
        if not self.enabled:
            return []
        got = await self.r.hgetall(self.key)
        return [lora.Adapter.from_json(str(name), text) for name, text in sorted(got.items())]

    async def register(self, name: str, path: str) -> lora.Adapter:
        """Register (or re-point) ``name``; the directory is read here: refused if unusable."""
        if not self.enabled:
            raise LoraDisabled("lora_name")
        if not name or len(name) > lora.MAX_NAME:
            raise InvalidArgument("lora_name", f"must be 1 to {lora.MAX_NAME} characters")
        if not path:
            raise InvalidArgument("lora_path", "must be set")
        try:
            adapter = await asyncio.to_thread(lora.read, name, path, self.max_rank)
        except lora.AdapterError as exc:
            raise InvalidArgument("lora_path", str(exc)) from exc
        await self.r.hset(self.key, name, adapter.to_json())
        self.seen[name] = adapter
        log.info("LoRA adapter %s registered: %s (digest %s, rank %d)", name, path, adapter.digest[:12], adapter.rank)
        return adapter

    async def unregister(self, name: str) -> None:
        if not self.enabled:
            raise LoraDisabled("lora_name")
        self.seen.pop(name, None)
        if not await self.r.hdel(self.key, name):
            raise unknown(name, "lora_name")
        log.info("LoRA adapter %s unregistered", name)
