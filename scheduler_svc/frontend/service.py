"""The request side of a scheduler replica: admit, stream, resume, cancel, drain.

Any replica can serve any request: it persists the request in Redis (which
queues it for every executor's loop), and follows the loops' events stream
(``bus.EventBus``: one reader per replica, fanned out to the requests it
serves) for tokens and finishes, wherever the request runs. A stream is only a
view of a request (``streams``: it never repeats or skips a token), and a
client whose stream broke resumes from its offset on any replica. A
request with sampling.n > 1 is its completions (``parallel``), streamed as one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry.trace import Span, Tracer
from opentelemetry.util.types import AttributeValue

from pagedserve import tracing
from pagedserve.grammar import Compiler, GrammarError
from pagedserve.lora import Adapter
from pagedserve.members import now_ms
from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.core import parallel, prefix
from scheduler_svc.core.admission import FinishRate, retry_after
from scheduler_svc.core.deadline import deadline_ms
from scheduler_svc.core.request import Finish, Request, Status
from scheduler_svc.frontend import bad_words, chat_template, tools
from scheduler_svc.frontend.attachments import Attachments
from scheduler_svc.frontend.bus import EventBus, StreamQueue
from scheduler_svc.frontend.detok import Detokenizer
from scheduler_svc.frontend.expiry import Expiries
from scheduler_svc.frontend.loras import LoraRegistry
from scheduler_svc.frontend.refusals import (
    InvalidArgument,
    NotFound,
    OutOfRange,
    QueueTimeout,
    StreamDetached,
    TooManyPending,
    Unavailable,
)
from scheduler_svc.frontend.streams import Chunk, Stream, follow
from scheduler_svc.frontend.validate import DEFAULT_CAPS, Caps, Checked, check, check_length, truncated
from scheduler_svc.frontend.watch import ClusterWatch
from scheduler_svc.metrics import FrontendMetrics
from scheduler_svc.state import codec
from scheduler_svc.state.store import UNAVAILABLE, Overloaded, RedisStore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Reopened:
    """A stream resumed from an offset (``Frontend._reopen``), before it is attached."""

    stream: Stream
    queue: StreamQueue
    first: list[Chunk]  # the tokens from the offset on that Redis holds
    req: Request
    stop: list[str]
    traceparent: str  # of the request's root span


def _end(span: Span | None, streams: list[Stream]) -> None:
    if span is not None:
        span.set_attribute("pagedserve.completion_tokens", sum(s.delivered for s in streams))
        span.end()


class Frontend:
    def __init__(
        self,
        store: RedisStore,
        bus: EventBus,
        watch: ClusterWatch,
        policy: str = "fcfs",
        attachments: Attachments | None = None,
        metrics: FrontendMetrics | None = None,
        tracer: Tracer | None = None,
        caps: Caps = DEFAULT_CAPS,
        max_pending: int = 0,
        tool_call_parser: str = "",
        loras: LoraRegistry | None = None,
    ) -> None:
        self.store = store
        self.bus = bus
        self.watch = watch
        self.policy = policy  # orders the shared queue; every replica of a namespace uses the same
        self.attachments = attachments or Attachments(store, policy)
        self.metrics = metrics
        self.tracer = tracer
        self.caps = caps
        self.max_pending = max_pending  # --max-pending-requests; 0: no limit
        self.tool_call_parser = tool_call_parser  # --tool-call-parser with --enable-auto-tool-choice; "": auto refused
        self.finish_rate = FinishRate()
        self.loras = loras or LoraRegistry(store.r, store.keys)  # disabled unless --enable-lora
        self._grammars: Compiler | None = None  # built on the first structured request
        self.expiries = Expiries(store)
        self._background: set[asyncio.Task[None]] = set()

    @property
    def tokenizer(self) -> Any:
        return self.watch.tokenizer

    def _tokenize(self, req: pb.GenerateRequest, checked: Checked) -> list[int]:
        if checked.kind == "prompt_token_ids":
            return list(req.prompt_token_ids)
        if checked.kind == "prompt":
            return list(self.tokenizer(req.prompt).input_ids)
        aware = tools.renders_tools(getattr(self.tokenizer, "chat_template", None))
        messages, tool_list = tools.template_messages(req, checked.tools, aware)
        return chat_template.render(self.tokenizer, messages, checked.template, tool_list)

    def _compile(self, checked: Checked) -> None:
        """A structured-output spec must compile here (xgrammar, this model's tokenizer), so that a
        bad one is refused at submission; compiled grammars are cached by spec (bounded in bytes)."""
        if checked.params.grammar is None:
            return
        if self._grammars is None:
            assert self.watch.limits is not None
            self._grammars = Compiler(self.tokenizer, self.watch.limits.vocab_size)
        try:
            self._grammars.compile(checked.params.grammar)
        except GrammarError as exc:
            raise InvalidArgument(checked.grammar_field, f"does not compile: {exc}") from exc

    def _check_open(self) -> None:
        if self.draining:
            raise Unavailable("this replica is draining; use another")
        if self.watch.limits is None or self.tokenizer is None:
            raise Unavailable("no executor has registered in this namespace yet")

    def prepare(
        self, req: pb.GenerateRequest, time_remaining: float | None = None, lora: Adapter | None = None
    ) -> tuple[Request, list[str]]:
        """Validate and tokenize; raises a refusal (``refusals``: InvalidArgument, ContextLength,
        OverCapacity, Unavailable).

        A sampled request without a seed gets one here, stored with it, so that a
        recompute after any failure produces the tokens it would have produced.
        Its queue deadline is the earlier of ``queue_timeout`` and ``time_remaining``
        (the call's gRPC deadline, seconds). ``lora``: the adapter it runs on, looked up by the
        caller (``LoraRegistry.resolve``: that takes a Redis read).
        """
        self._check_open()
        limits = self.watch.limits
        assert limits is not None
        checked = check(req, limits, self.caps, self.tool_call_parser)
        self._compile(checked)
        params = checked.params
        prompt = truncated(self._tokenize(req, checked), checked.truncate_prompt_tokens, params, limits)
        check_length(checked.kind, len(prompt), params, limits)
        if checked.bad_words:
            params = replace(
                params, bad_words=bad_words.sequences(self.tokenizer, list(checked.bad_words), limits.vocab_size)
            )
        if params.temperature > 0 and params.seed is None:
            params = replace(params, seed=secrets.randbits(63))
        rid = checked.request_id or uuid.uuid4().hex
        return (
            Request(
                rid,
                prompt,
                params,
                priority=checked.priority,
                deadline_ms=deadline_ms(now_ms(), checked.queue_timeout, time_remaining),
                cache_salt=checked.cache_salt,
                lora=lora,
            ),
            checked.stop,
        )

    async def _cancel(self, request_id: str, reason: Finish) -> None:
        try:
            await self.store.cancel(request_id, reason)
        except UNAVAILABLE as exc:
            log.warning("could not cancel %s (%s): %s", request_id, reason.value, exc, extra={"request_id": request_id})

    def _cancel_later(self, request_id: str, reason: Finish) -> None:
        """Cancel even while the caller's task is being cancelled."""
        task = asyncio.get_running_loop().create_task(self._cancel(request_id, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _attached(
        self, s: Stream, queue: StreamQueue, first: list[Chunk], touch: bool = False
    ) -> AsyncIterator[Chunk]:
        """Stream ``first``, then the live tail; the request is held (attached) meanwhile, and
        ``touch`` refreshes that at once. A client that goes away aborts it; a draining replica
        or a Redis outage leaves it running."""
        rid = s.request_id
        if self.metrics is not None:
            self.metrics.streams.labels(self.watch.model).inc()
        try:
            if touch and not s.done:
                await self.attachments.touch(rid)
            for chunk in first:
                await self._with_prompt_logprobs(s, chunk)
                self._observe(s, chunk)
                yield chunk
            async for chunk in follow(self.store, s, queue):
                await self._with_prompt_logprobs(s, chunk)
                self._observe(s, chunk)
                yield chunk
        except StreamDetached:
            s.done = True  # nothing to abort: the client resumes elsewhere
            raise
        except QueueTimeout:
            s.done = True  # it ended (expired): nothing to abort
            raise
        except UNAVAILABLE as exc:
            s.done = True  # a Redis outage is no reason to abort: the client resumes once it is back
            raise StreamDetached(rid, s.delivered, f"redis unavailable ({exc})") from exc
        finally:
            if self.metrics is not None:
                self.metrics.streams.labels(self.watch.model).dec()
            self.bus.unsubscribe(rid, queue)
            self.attachments.release(rid)
            if not s.done:
                self._cancel_later(rid, Finish.ABORT)  # the client went away: free its blocks

    async def _with_prompt_logprobs(self, s: Stream, chunk: Chunk) -> None:
        """The first message with tokens (or the last) carries the prompt's logprobs, read from
        Redis: the step that sampled the first token committed them with it."""
        if s.prompt_pending and (chunk.token_ids or chunk.finish_reason):
            s.prompt_pending = False
            chunk.prompt_logprobs = await self.store.prompt_logprobs(s.request_id)

    def _observe(self, s: Stream, chunk: Chunk) -> None:
        """TTFT (streams that submitted), inter-token latency, end-to-end latency."""
        if self.metrics is None:
            return
        now, m = time.time(), self.watch.model
        if chunk.token_ids:
            if s.first_pending:
                self.metrics.ttft.labels(m).observe(now - s.submitted)
            elif s.last:
                self.metrics.itl.labels(m).observe(now - s.last)
            s.first_pending, s.last = False, now
        if chunk.finish_reason:
            self.metrics.e2e.labels(m).observe(now - s.submitted)

    def _span(
        self, name: str, rid: str, traceparent: str = "", attrs: dict[str, AttributeValue] | None = None
    ) -> Span | None:
        if self.tracer is None:
            return None
        return self.tracer.start_span(
            name, context=tracing.parent(traceparent), attributes={"pagedserve.request_id": rid, **(attrs or {})}
        )

    async def _submit(self, reqs: list[Request], stop: list[str], trace: str, check: bool = True) -> None:
        """Submit a request (or a group's completions, together) under admission control (``check``
        False: none, for a batch's prompts after the first); raises TooManyPending with a retry hint."""
        req = reqs[0]
        try:
            limits = self.watch.limits
            hashes = (
                prefix.prompt_hashes(req.prompt_ids, req.cache_salt, limits.block_size, req.adapter_digest)
                if limits
                else []
            )
            most = self.max_pending if check else 0
            seen = await self.store.admit_group(reqs, stop, self.policy, trace, most, hashes=hashes)
        except Overloaded as exc:
            self.finish_rate.add(time.monotonic(), exc.seen.finished)
            hint = retry_after(exc.seen.queued, self.max_pending, self.finish_rate.per_s())
            raise TooManyPending(exc.seen.queued, self.max_pending, hint) from None
        self.finish_rate.add(time.monotonic(), seen.finished)

    def _stream(self, req: Request, stop: list[str], submitted: float, **kw: Any) -> Stream:
        return Stream(
            req.request_id,
            len(req.prompt_ids),
            Detokenizer(self.tokenizer, stop, include_stop=req.params.include_stop_str_in_output),
            submitted,
            functools.partial(self._cancel_later, reason=Finish.STOP),
            logprobs=req.params.logprobs is not None,
            group=req.group,
            index=req.index,
            **kw,
        )

    def _views(
        self, streams: list[Stream], queues: list[StreamQueue], firsts: list[list[Chunk]], touch: bool = False
    ) -> AsyncIterator[Chunk]:
        """The attached stream of a request (no extra layer: a decode step streams hundreds of
        chunks), or its completions' streams merged into one (``_merged``)."""
        views = [self._attached(s, q, f, touch) for s, q, f in zip(streams, queues, firsts)]
        return views[0] if len(views) == 1 else self._merged(streams, views)

    async def _merged(self, streams: list[Stream], views: list[AsyncIterator[Chunk]]) -> AsyncIterator[Chunk]:
        """A drain or a Redis outage ends every completion's stream, leaving them all running: the
        client resumes the group from the least offset of the completions that had not ended (a
        batch of prompts: the error names its first request; each request of it goes on)."""
        detached: list[int] = []

        def keep_running(exc: BaseException) -> None:
            if isinstance(exc, StreamDetached):
                detached.append(min([exc.offset] + [s.delivered for s in streams if not s.done]))
                for s in streams:
                    s.done = True  # closing the others must not abort them

        try:
            async for chunk in parallel.merge(views, keep_running):
                yield chunk
        except StreamDetached as exc:
            raise StreamDetached(streams[0].group or streams[0].request_id, detached[0], exc.why) from None
        except QueueTimeout:
            raise QueueTimeout(streams[0].group or streams[0].request_id) from None

    async def generate(self, req: Request | list[Request], stop: list[str]) -> AsyncIterator[Chunk]:
        """Submit ``req`` and stream it; with sampling.n > 1, its completions (``parallel``), merged.
        A list is a batch of prompts (the HTTP door's ``prompt: [...]``), each its own request:
        submitted in order and admitted as one group of completions is (``--max-pending-requests``
        checked once, for the first), all or none, and streamed merged; chunks carry their
        request's id."""
        batch = req if isinstance(req, list) else [req]
        rid = batch[0].request_id
        span = self._span(
            "pagedserve.request",
            rid,
            attrs={
                "pagedserve.prompt_tokens": sum(len(r.prompt_ids) for r in batch),
                "pagedserve.max_tokens": batch[0].params.max_tokens,
            },
        )
        groups = [parallel.completions(r) for r in batch]
        reqs = [c for g in groups for c in g]
        queues = [self.bus.subscribe(r.request_id) for r in reqs]
        submitted = time.time()
        streams = [self._stream(r, stop, submitted, prompt_pending=r.params.prompt_logprobs is not None) for r in reqs]
        timers: list[asyncio.Task[None]] = []
        try:
            landed = 0  # groups queued
            try:
                trace = tracing.traceparent(span) if span else ""
                for i, group in enumerate(groups):
                    await self._submit(group, stop, trace, check=i == 0)
                    landed += 1
            except BaseException as exc:
                for r, q in zip(reqs, queues):
                    self.bus.unsubscribe(r.request_id, q)
                if isinstance(exc, asyncio.CancelledError):
                    landed += 1  # the one being submitted may have landed
                for g in groups[:landed]:
                    for r in g:
                        self._cancel_later(r.request_id, Finish.ABORT)
                raise
            for r in reqs:
                self.attachments.hold(r, stop)
            timers = self.expiries.start(reqs)
            async for chunk in self._views(streams, queues, [[] for _ in reqs]):
                yield chunk
        finally:
            self.expiries.stop(timers)
            _end(span, streams)

    async def _reopen(self, request_id: str, offset: int, clamp: bool = False) -> _Reopened:
        """A stream of ``request_id`` from ``offset`` on (``clamp``: from its end if it has fewer
        tokens), subscribed to its events, with its first chunks; raises NotFound, OutOfRange,
        QueueTimeout."""
        queue = self.bus.subscribe(request_id)  # before reading: no event falls between the read and the tail
        try:
            got = await self.store.request(request_id)
            if got is None:
                raise NotFound("request_id", f"no live or recently finished request {request_id!r}")
            fields, out = got
            offset = min(offset, len(out)) if clamp else offset
            if offset > len(out):
                raise OutOfRange("offset", f"{offset} is past the {len(out)} tokens generated so far")
            req = codec.request_from(request_id, fields, out)
            if req.status == Status.FINISHED and fields.get("finish_reason") == Finish.DEADLINE.value:
                raise QueueTimeout(req.group or request_id)
            stop = codec.stop_of(fields)
            s = self._stream(
                req,
                stop,
                int(fields.get("ts", 0)) / 1000,
                first_pending=False,
                prompt_pending=req.params.prompt_logprobs is not None and offset == 0,
                cached=req.num_cached,
            )
            s.detok.add(req.output_ids[:offset])  # what the client has: the text state it left off at
            s.detok.take(final=False)
            s.delivered = offset
            finished = fields.get("finish_reason") if req.status == Status.FINISHED else None
            if s.detok.stopped:
                first = [s.chunk([], offset, final=True, reason=Finish.STOP.value)]
            else:
                lps = None
                if s.logprobs:
                    lps = (await self.store.logprobs(request_id, offset))[: len(req.output_ids) - offset]
                first = [c for c in [s.deliver(req.output_ids[offset:], finished, lps)] if c is not None]
        except BaseException:
            self.bus.unsubscribe(request_id, queue)
            raise
        return _Reopened(s, queue, first, req, stop, fields.get("tp", ""))

    async def resume(self, request_id: str, offset: int, index: int | None = None) -> AsyncIterator[Chunk]:
        """The tokens from ``offset`` on, the live tail, the final message; raises NotFound, OutOfRange.
        For a request with sampling.n > 1: of completion ``index``, or of every completion (each from
        ``offset`` or its end, merged)."""
        self._check_open()
        n = await self.store.group_size(request_id)
        if n == 0 and index:
            if await self.store.request(request_id) is None:  # nothing got in (the resuming client submits it)
                raise NotFound("request_id", f"no live or recently finished request {request_id!r}")
            raise OutOfRange("index", f"{index}, but request {request_id!r} has one completion")
        if index is not None and n and index >= n:
            raise OutOfRange("index", f"{index}, but request {request_id!r} has {n} completions")
        ids = (
            [request_id]
            if n == 0
            else [parallel.completion_id(request_id, i) for i in ([index] if index is not None else range(n))]
        )
        opened: list[_Reopened] = []
        try:
            for rid in ids:
                opened.append(await self._reopen(rid, offset, clamp=n > 0 and index is None))
        except BaseException:
            for o in opened:
                self.bus.unsubscribe(o.stream.request_id, o.queue)
            raise
        streams = [o.stream for o in opened]
        live = [o for o in opened if not o.stream.done]
        for o in live:
            self.attachments.hold(o.req, o.stop)
        timers = self.expiries.start([o.req for o in live])
        span = self._span("pagedserve.resume", request_id, opened[0].traceparent, {"pagedserve.offset": offset})
        try:
            async for chunk in self._views(streams, [o.queue for o in opened], [o.first for o in opened], touch=True):
                yield chunk
        finally:
            self.expiries.stop(timers)
            _end(span, streams)

    async def abort(self, request_id: str) -> bool:
        """Abort a request, or every completion of one with sampling.n > 1; False if none was live."""
        if await self.store.cancel(request_id, Finish.ABORT):
            return True
        found = [
            await self.store.cancel(parallel.completion_id(request_id, i), Finish.ABORT)
            for i in range(await self.store.group_size(request_id))
        ]
        return any(found)

    @property
    def draining(self) -> bool:
        """Whether this replica drains (its bus knows: it ends every stream, open or opened since)."""
        return self.bus.draining

    def drain(self) -> None:
        """Stop taking streams and end the open ones (their requests go on)."""
        self.bus.drain()
