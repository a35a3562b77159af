"""The request side of a scheduler replica: admit, stream, cancel.

Any replica can serve any request: it persists the request in Redis, and
follows the loop's per-step events stream (one reader per replica, fanned out
to the requests it serves) for tokens and finishes, wherever the loop runs.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from scheduler_svc.core.request import Finish, Request
from scheduler_svc.detok import Detokenizer
from scheduler_svc.store import UNAVAILABLE, RedisStore
from scheduler_svc.validate import Checked, InvalidArgument, Limits, check, check_length
from pagedserve.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)


def load_tokenizer(files: dict[str, bytes]) -> Any:
    """A tokenizer from the files the executor sent (the scheduler holds no model)."""
    with tempfile.TemporaryDirectory(prefix="pagedserve-tok-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)


@dataclass(slots=True)
class Chunk:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_pb(self) -> pb.GenerateResponse:
        return pb.GenerateResponse(
            request_id=self.request_id,
            token_ids=self.token_ids,
            text=self.text,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
        )


class EventBus:
    """Reads the loop's events stream once per replica and routes them by request."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self._queues: dict[str, asyncio.Queue[tuple[str, Any]]] = {}

    def subscribe(self, request_id: str) -> asyncio.Queue[tuple[str, Any]]:
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def run(self, stop: asyncio.Event) -> None:
        last = await self.store.events_tail()
        while not stop.is_set():
            try:
                events = await self.store.read_events(last, block_ms=500)
            except UNAVAILABLE as exc:
                log.warning("events stream unavailable (%s); retrying", exc)
                await asyncio.sleep(1)
                continue
            for eid, data in events:
                last = eid
                for rid, tokens in data.get("t", {}).items():
                    if (q := self._queues.get(rid)) is not None:
                        q.put_nowait(("t", tokens))
                for rid, fin in data.get("f", {}).items():
                    if (q := self._queues.get(rid)) is not None:
                        q.put_nowait(("f", fin))


class Frontend:
    def __init__(self, store: RedisStore, bus: EventBus, tokenizer: Any, limits: Limits) -> None:
        self.store = store
        self.bus = bus
        self.tokenizer = tokenizer
        self.limits = limits
        self._background: set[asyncio.Task[None]] = set()

    def _tokenize(self, req: pb.GenerateRequest, checked: Checked) -> list[int]:
        if checked.kind == "prompt_token_ids":
            return list(req.prompt_token_ids)
        if checked.kind == "prompt":
            return list(self.tokenizer(req.prompt).input_ids)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja errors: the template refused these messages
            raise InvalidArgument(f"messages: the chat template rejected them: {exc}") from exc
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def prepare(self, req: pb.GenerateRequest) -> tuple[Request, list[str]]:
        """Validate and tokenize; raises InvalidArgument or OverCapacity."""
        checked = check(req, self.limits)
        prompt = self._tokenize(req, checked)
        check_length(checked.kind, len(prompt), checked.params, self.limits)
        rid = checked.request_id or uuid.uuid4().hex
        return Request(rid, prompt, checked.params, priority=checked.priority), checked.stop

    async def _send(self, op: str, request_id: str) -> None:
        try:
            await self.store.send(op, request_id)
        except UNAVAILABLE as exc:
            log.warning("could not queue %s for %s: %s", op, request_id, exc)

    def _send_later(self, op: str, request_id: str) -> None:
        """Queue an operation even while the caller's task is being cancelled."""
        task = asyncio.get_running_loop().create_task(self._send(op, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def generate(self, req: Request, stop: list[str]) -> AsyncIterator[Chunk]:
        rid = req.request_id
        queue = self.bus.subscribe(rid)
        detok = Detokenizer(self.tokenizer, stop)
        done = submitted = False
        try:
            await self.store.submit(req, stop)
            submitted = True
            while not done:
                kind, payload = await queue.get()
                if kind == "t":
                    tokens = detok.add(payload)
                    if detok.stopped:
                        self._send_later("stop", rid)
                        done = True
                        yield Chunk(rid, tokens, detok.take(final=True), Finish.STOP.value,
                                    len(req.prompt_ids), len(detok.ids))
                    elif tokens:
                        yield Chunk(rid, tokens, detok.take(final=False))
                else:
                    reason, prompt_tokens, _ = payload
                    done = True
                    yield Chunk(rid, [], detok.take(final=True), reason, prompt_tokens, len(detok.ids))
        finally:
            self.bus.unsubscribe(rid)
            if submitted and not done:
                self._send_later("abort", rid)  # the client went away: free its blocks

    async def abort(self, request_id: str) -> bool:
        if not await self.store.is_live(request_id):
            return False
        await self.store.send("abort", request_id)
        return True
