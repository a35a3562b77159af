"""A stream is a view of a request: what it has delivered to one client, and the text so far.

The loops' events carry each token's offset in the completion, so a stream
never repeats or skips a token: overlap is dropped, a gap is read back from
Redis (``fresh``). ``follow`` turns a request's events (``bus.StreamQueue``)
into the chunks its client receives; the frontend (``frontend.Frontend``)
attaches, resumes and ends streams around it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.core.logprob import Logprob
from scheduler_svc.core.request import Finish
from scheduler_svc.frontend.bus import DRAIN, StreamQueue
from scheduler_svc.frontend.detok import Detokenizer
from scheduler_svc.frontend.refusals import QueueTimeout, StreamDetached
from scheduler_svc.state.store import RedisStore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    request_id: str
    token_ids: list[int]
    text: str
    offset: int  # index in the completion of token_ids[0]
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[Logprob] | None = None  # one per token of token_ids
    prompt_logprobs: list[Logprob] | None = None  # one per prompt token from the second on
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (last message)
    index: int = 0  # which completion of a request with sampling.n > 1

    def to_pb(self) -> pb.GenerateResponse:
        return pb.GenerateResponse(
            request_id=self.request_id,
            index=self.index,
            token_ids=self.token_ids,
            text=self.text,
            offset=self.offset,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            logprobs=[token_logprobs(e) for e in self.logprobs or ()],
            prompt_logprobs=[token_logprobs(e) for e in self.prompt_logprobs or ()],
            cached_tokens=self.cached_tokens,
        )


def token_logprobs(e: Logprob) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=e.token_id, logprob=e.logprob, rank=e.rank, top_token_ids=e.top_ids, top_logprobs=e.top_logprobs
    )


@dataclass(slots=True)
class Stream:
    """One attached stream: what it has delivered and what turns tokens into text."""

    request_id: str
    prompt_tokens: int
    detok: Detokenizer
    submitted: float  # wall time of the submission (s)
    # Ends the request when a stop string ends its text before the loop finished it (the frontend's cancel).
    on_stop: Callable[[str], None]
    delivered: int = 0  # tokens of the completion given to the detokenizer so far
    done: bool = False
    first_pending: bool = True  # no token streamed yet: the next one is the first (TTFT)
    last: float = 0.0  # when the last message with tokens left
    logprobs: bool = False  # sampling.logprobs is set: messages carry them
    prompt_pending: bool = False  # sampling.prompt_logprobs is set and the first message has not left
    cached: int = 0  # prompt tokens served from the prefix cache, as the finish event says
    group: str = ""  # a completion of a request with sampling.n > 1: that request's id (what chunks carry)
    index: int = 0  # and which completion

    def chunk(
        self,
        tokens: list[int],
        offset: int,
        final: bool = False,
        reason: str = "",
        logprobs: list[Logprob] | None = None,
    ) -> Chunk:
        text = self.detok.take(final=final)
        lps = logprobs[: len(tokens)] if self.logprobs and logprobs is not None else None
        rid = self.group or self.request_id
        if not final:
            return Chunk(rid, tokens, text, offset, logprobs=lps, index=self.index)
        self.done = True
        return Chunk(
            rid,
            tokens,
            text,
            offset,
            reason,
            self.prompt_tokens,
            len(self.detok.ids),
            logprobs=lps,
            cached_tokens=self.cached,
            index=self.index,
        )

    def deliver(self, tokens: list[int], finished: str | None = None, lps: list[Any] | None = None) -> Chunk | None:
        """Take ``tokens`` (the completion's next ones, ``lps`` their logprobs); ``finished``: the
        request's finish reason when these are its last. Returns the chunk to send, if any."""
        offset = self.delivered
        self.delivered += len(tokens)
        accepted = self.detok.add(tokens)
        if self.detok.stopped:  # a stop string: the text ends here whatever the loop does next
            if finished is None:
                self.on_stop(self.request_id)
            return self.chunk(accepted, offset, final=True, reason=Finish.STOP.value, logprobs=lps)
        if finished is not None:
            return self.chunk(accepted, offset, final=True, reason=finished, logprobs=lps)
        return self.chunk(accepted, offset, logprobs=lps) if accepted else None


async def fresh(
    store: RedisStore, s: Stream, offset: int, tokens: list[int], lps: list[Any] | None = None
) -> tuple[list[int], list[Any] | None]:
    """The tokens (and logprobs) of an event not yet delivered: overlap dropped, a gap
    filled from Redis."""
    if offset > s.delivered:
        log.warning(
            "%s: events skipped tokens %d..%d; reading them back",
            s.request_id,
            s.delivered,
            offset,
            extra={"request_id": s.request_id},
        )
        gap = await store.output(s.request_id, s.delivered, offset)
        gap_lps = await store.logprobs(s.request_id, s.delivered, offset) if s.logprobs else None
        return gap + tokens, (gap_lps + (lps or [])) if s.logprobs and gap_lps is not None else None
    cut = s.delivered - offset
    return tokens[cut:], (lps[cut:] if lps is not None else None)


async def follow(store: RedisStore, s: Stream, queue: StreamQueue) -> AsyncIterator[Chunk]:
    """The chunks of ``s``'s events until it ends; raises StreamDetached on a drain, QueueTimeout
    when its queue deadline passed."""
    while not s.done:
        kind, payload = await queue.get()
        if kind == DRAIN:
            raise StreamDetached(s.request_id, s.delivered)
        if kind == "t":
            offset, toks, lps = payload
            toks, lps = await fresh(store, s, offset, toks, lps)
            chunk = s.deliver(toks, lps=lps)
        else:
            reason, total, s.cached = payload
            if reason == Finish.DEADLINE.value:
                s.done = True
                raise QueueTimeout(s.request_id)
            toks, lps = await fresh(store, s, total, [], [])
            chunk = s.deliver(toks, finished=reason, lps=lps)
        if chunk is not None:
            yield chunk
