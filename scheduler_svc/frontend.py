"""The request side of a scheduler replica: admit, stream, cancel.

Any replica can serve any request: it persists the request in Redis (which
queues it for every executor's loop), and follows the loops' events stream
(one reader per replica, fanned out to the requests it serves) for tokens and
finishes, wherever the request runs. Events carry each token's offset in the
completion, so a stream never repeats or skips a token: overlap is dropped,
and a gap is filled from the request's output list.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from scheduler_svc.codec import Event
from scheduler_svc.core.request import Finish, Request
from scheduler_svc.detok import Detokenizer
from scheduler_svc.store import UNAVAILABLE, RedisStore
from scheduler_svc.validate import Checked, InvalidArgument, Unavailable, check, check_length
from scheduler_svc.watch import ClusterWatch
from pagedserve.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)


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
            for eid, event in events:
                last = eid
                self._route(event)

    def _route(self, event: Event) -> None:
        for rid, tokens in event.tokens.items():
            if (q := self._queues.get(rid)) is not None:
                q.put_nowait(("t", tokens))
        for rid, fin in event.finished.items():
            if (q := self._queues.get(rid)) is not None:
                q.put_nowait(("f", fin))


class Frontend:
    def __init__(self, store: RedisStore, bus: EventBus, watch: ClusterWatch, policy: str = "fcfs") -> None:
        self.store = store
        self.bus = bus
        self.watch = watch
        self.policy = policy  # orders the shared queue; every replica of a namespace uses the same
        self._background: set[asyncio.Task[None]] = set()

    @property
    def tokenizer(self) -> Any:
        return self.watch.tokenizer

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
        """Validate and tokenize; raises InvalidArgument, OverCapacity or Unavailable."""
        limits = self.watch.limits
        if limits is None or self.tokenizer is None:
            raise Unavailable("no executor has registered in this namespace yet")
        checked = check(req, limits)
        prompt = self._tokenize(req, checked)
        check_length(checked.kind, len(prompt), checked.params, limits)
        rid = checked.request_id or uuid.uuid4().hex
        return Request(rid, prompt, checked.params, priority=checked.priority), checked.stop

    async def _cancel(self, request_id: str, reason: Finish) -> None:
        try:
            await self.store.cancel(request_id, reason)
        except UNAVAILABLE as exc:
            log.warning("could not cancel %s (%s): %s", request_id, reason.value, exc)

    def _cancel_later(self, request_id: str, reason: Finish) -> None:
        """Cancel even while the caller's task is being cancelled."""
        task = asyncio.get_running_loop().create_task(self._cancel(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _fresh(self, rid: str, delivered: int, offset: int, tokens: list[int]) -> list[int]:
        """The tokens of an event not yet delivered: overlap dropped, a gap filled from Redis."""
        if offset > delivered:
            log.warning("%s: events skipped tokens %d..%d; reading them back", rid, delivered, offset)
            return await self.store.output(rid, delivered, offset) + tokens
        return tokens[delivered - offset :]

    async def generate(self, req: Request, stop: list[str]) -> AsyncIterator[Chunk]:
        rid = req.request_id
        queue = self.bus.subscribe(rid)
        detok = Detokenizer(self.tokenizer, stop)
        done = submitted = False
        delivered = 0  # tokens of the completion taken from events so far
        try:
            await self.store.submit(req, stop, self.policy)
            submitted = True
            while not done:
                kind, payload = await queue.get()
                if kind == "t":
                    offset, toks = payload
                    fresh = await self._fresh(rid, delivered, offset, toks)
                    delivered += len(fresh)
                    tokens = detok.add(fresh)
                    if detok.stopped:
                        self._cancel_later(rid, Finish.STOP)
                        done = True
                        yield Chunk(rid, tokens, detok.take(final=True), Finish.STOP.value,
                                    len(req.prompt_ids), len(detok.ids))
                    elif tokens:
                        yield Chunk(rid, tokens, detok.take(final=False))
                else:
                    reason, total = payload
                    tokens = detok.add(await self._fresh(rid, delivered, total, []))
                    done = True
                    yield Chunk(rid, tokens, detok.take(final=True), reason, len(req.prompt_ids), len(detok.ids))
        finally:
            self.bus.unsubscribe(rid)
            if submitted and not done:
                self._cancel_later(rid, Finish.ABORT)  # the client went away: free its blocks

    async def abort(self, request_id: str) -> bool:
        return await self.store.cancel(request_id, Finish.ABORT)
