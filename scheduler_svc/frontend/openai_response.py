"""OpenAI's answers from the frontend's chunks: pure functions on plain data (no I/O).

``Shape`` builds one request's response object (``body``, from the ``Collected``
completions) or its stream chunks (``opening``, ``events`` per frontend ``Chunk``,
``closing``), in the shapes of ``/v1/completions`` and ``/v1/chat/completions``,
logprobs and vLLM's extensions included. docs/http.md has the tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.core.logprob import Logprob
from scheduler_svc.frontend.openai_request import Parsed
from scheduler_svc.frontend.streams import Chunk


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(slots=True)
class Collected:
    """A whole completion, gathered from its chunks (non-streaming answers)."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] | None = None
    cached_tokens: int = 0

    def add(self, chunk: Chunk) -> None:
        self.texts.append(chunk.text)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs or []
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
            self.prompt_tokens, self.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens
            self.cached_tokens = chunk.cached_tokens


@dataclass(slots=True)
class _Choice:
    """What a stream keeps per choice (one per completion of ``n``)."""

    pending: list[Logprob] = field(default_factory=list)  # logprobs of tokens not yet streamed (no text yet)
    pending_prompt: list[Logprob] | None = None  # prompt logprobs that came with a chunk not yet streamed
    text_offset: int = 0  # completions' text_offset of the next token
    final: Chunk | None = None  # its last chunk, once seen (its token counts)


@dataclass(slots=True)
class Shape:
    """OpenAI's objects for one request. Finish reasons pass through: ``stop``, ``length``,
    and ``abort`` (as vLLM reports a request stopped by an abort). With ``n`` > 1 there is a
    choice per completion (its ``index``); usage counts the prompt once and every completion."""

    parsed: Parsed
    request_id: str
    created: int
    model: str
    prompt_ids: list[int] = field(default_factory=list)
    decode: Callable[[int], str] = str  # one token's text (the tokenizer's), for logprobs
    _choices: dict[int, _Choice] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return max(1, self.parsed.request.sampling.n)

    def _state(self, index: int) -> _Choice:
        return self._choices.setdefault(index, _Choice())

    @property
    def wants_logprobs(self) -> bool:
        return self.parsed.request.sampling.HasField("logprobs")

    def _logprobs(self, entries: list[Logprob], state: _Choice) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens' entries."""
        if not self.wants_logprobs:
            return None
        if self.parsed.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self.decode(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(state.text_offset)
            state.text_offset += len(t)
        # As vLLM: the sampled token is among its position's top_logprobs, with the top k.
        tops = [
            {self.decode(i): lp for i, lp in zip(e.top_ids, e.top_logprobs)} | {tok: e.logprob}
            for e, tok in zip(entries, tokens)
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, e: Logprob) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.decode(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

        return one(e.token_id, e.logprob) | {"top_logprobs": [one(i, lp) for i, lp in zip(e.top_ids, e.top_logprobs)]}

    def _prompt_logprobs(self, entries: list[Logprob]) -> list[Any]:
        """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank,
        decoded_token}} with the prompt token and its top alternatives."""

        def one(token_id: int, logprob: float, rank: int | None) -> tuple[str, dict[str, Any]]:
            return str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": self.decode(token_id)}

        out: list[Any] = [None]
        for e in entries:
            alts = dict(one(i, lp, r + 1) for r, (i, lp) in enumerate(zip(e.top_ids, e.top_logprobs)))
            out.append(alts | dict([one(e.token_id, e.logprob, e.rank)]))
        return out

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.parsed.chat else "cmpl-") + self.request_id

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(
        self,
        index: int,
        text: str,
        finish: str | None,
        token_ids: list[int],
        delta: bool,
        logprobs: list[Any] | None = None,
        prompt_logprobs: list[Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if not self.parsed.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice |= {"logprobs": self._logprobs(logprobs or [], self._state(index)), "finish_reason": finish or None}
        if prompt_logprobs is not None and not self.parsed.chat:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt_logprobs)
        if self.parsed.return_token_ids:
            choice["token_ids"] = token_ids
            if not self.parsed.chat and not delta:
                choice["prompt_token_ids"] = self.prompt_ids
        return choice

    def body(self, done: list[Collected]) -> dict[str, Any]:
        """The non-streaming answer, from each completion gathered (by index)."""
        out = self._head("chat.completion" if self.parsed.chat else "text_completion")
        out["choices"] = [
            self._choice(
                i,
                "".join(d.texts),
                d.finish_reason,
                d.token_ids,
                delta=False,
                logprobs=d.logprobs,
                prompt_logprobs=d.prompt_logprobs,
            )
            for i, d in enumerate(done)
        ]
        prompt = done[0].prompt_logprobs
        if self.parsed.chat and prompt is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(prompt)  # vLLM: beside the choices
        out["usage"] = usage(done[0].prompt_tokens, sum(d.completion_tokens for d in done), done[0].cached_tokens)
        if self.parsed.chat and self.parsed.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self._head("chat.completion.chunk" if self.parsed.chat else "text_completion") | {"choices": choices}
        if self.parsed.include_usage:
            out["usage"] = None
        return out

    def opening(self) -> list[dict[str, Any]]:
        """What a stream starts with: the assistant's role, for chat (one chunk per choice)."""
        if not self.parsed.chat:
            return []
        return [
            self._chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
            for i in range(self.n)
        ]

    def events(self, chunk: Chunk) -> list[dict[str, Any]]:
        """The stream chunks for one frontend chunk (none for tokens that are no text yet)."""
        state = self._state(chunk.index)
        state.pending += chunk.logprobs or []
        if chunk.prompt_logprobs is not None:
            state.pending_prompt = chunk.prompt_logprobs
        if chunk.finish_reason:
            state.final = chunk
        elif not chunk.text and not (self.parsed.return_token_ids and chunk.token_ids):
            return []  # its logprobs go with the next chunk that has text
        pending, state.pending = state.pending, []
        prompt, state.pending_prompt = state.pending_prompt, None
        out = self._chunk(
            [
                self._choice(
                    chunk.index,
                    chunk.text,
                    chunk.finish_reason,
                    chunk.token_ids,
                    delta=True,
                    logprobs=pending,
                    prompt_logprobs=prompt,
                )
            ]
        )
        if self.parsed.chat and prompt is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(prompt)
        return [out]

    def closing(self) -> list[dict[str, Any]]:
        """After the last chunk: the usage chunk, when ``stream_options.include_usage`` asked for it."""
        finals = [c.final for c in self._choices.values() if c.final is not None]
        if not self.parsed.include_usage or not finals:
            return []
        out = self._head("chat.completion.chunk" if self.parsed.chat else "text_completion")
        return [
            out
            | {
                "choices": [],
                "usage": usage(
                    finals[0].prompt_tokens, sum(f.completion_tokens for f in finals), finals[0].cached_tokens
                ),
            }
        ]
