"""OpenAI's answers from the frontend's chunks: pure functions on plain data (no I/O).

``Shape`` builds one request's response object (``body``, from the ``Collected``
completions) or its stream chunks (``opening``, ``events`` per frontend ``Chunk``,
``closing``), in the shapes of ``/v1/completions`` and ``/v1/chat/completions``,
logprobs and vLLM's extensions included; a batch of prompts (``batch``) is one answer,
and ``echo`` puts each prompt in front of its choices. docs/http.md has the tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.core.logprob import Logprob
from scheduler_svc.frontend.echo import Echo, Entry, entries, prefixed
from scheduler_svc.frontend.openai_request import Parsed
from scheduler_svc.frontend.streams import Chunk
from scheduler_svc.frontend.tool_calls import Named, Reader, finish_reason, read_all, reader
from scheduler_svc.frontend.tools import Plan


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
    echoed: bool = False  # echo: the prompt has been streamed in front of it
    held: list[Chunk] = field(default_factory=list)  # echo with logprobs: waiting for its prompt's logprobs
    reader: Reader | None = None  # chat with tools: the calls in its text (tool_calls)
    named: Named | None = None  # tool_choice a function: its arguments streamed as they come
    calls: int = 0  # tool calls streamed so far


@dataclass(slots=True)
class Shape:
    """OpenAI's objects for one request. Finish reasons pass through: ``stop``, ``length``,
    and ``abort`` (as vLLM reports a request stopped by an abort). With ``n`` > 1 there is a
    choice per completion (its ``index``); usage counts the prompt once and every completion.
    A batch has ``prompts`` (each sampled with ``parsed``'s parameters): choice ``index`` is
    prompt index × n + completion index, and usage adds up over the prompts."""

    parsed: Parsed
    request_id: str
    created: int
    model: str
    prompts: list[list[int]] = field(default_factory=list)  # each prompt's token ids
    decode: Callable[[int], str] = str  # one token's text (the tokenizer's), for logprobs
    echo: Echo | None = None
    tools: Plan | None = None  # chat with tools: calls are read from the text (tool_calls)
    _choices: dict[int, _Choice] = field(default_factory=dict)
    _prompt_lps: dict[int, list[Logprob]] = field(default_factory=dict)  # by prompt, once seen (streams)

    @property
    def n(self) -> int:
        return max(1, self.parsed.request.sampling.n)

    def _state(self, index: int) -> _Choice:
        if index not in self._choices:
            chat, plan = self.parsed.chat, self.tools
            named = Named(plan.function) if chat and plan is not None and plan.mode == "named" else None
            self._choices[index] = _Choice(reader=reader(plan) if chat else None, named=named)
        return self._choices[index]

    @property
    def wants_logprobs(self) -> bool:
        return self.parsed.request.sampling.HasField("logprobs")

    def _logprobs(self, entries: list[Entry], state: _Choice) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens' entries (a bare id: a token without any,
        echo's first prompt token: null logprob and top_logprobs, as vLLM)."""
        if not self.wants_logprobs:
            return None
        if self.parsed.chat:
            return {"content": [self._chat_entry(e) for e in entries if not isinstance(e, int)]}
        tokens = [self.decode(e if isinstance(e, int) else e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(state.text_offset)
            state.text_offset += len(t)
        # As vLLM: the sampled token is among its position's top_logprobs, with the top k.
        tops = [
            None
            if isinstance(e, int)
            else {self.decode(i): lp for i, lp in zip(e.top_ids, e.top_logprobs)} | {tok: e.logprob}
            for e, tok in zip(entries, tokens)
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [None if isinstance(e, int) else e.logprob for e in entries],
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
        text: str | None,
        finish: str | None,
        token_ids: list[int],
        delta: bool,
        logprobs: list[Entry] | None = None,
        prompt_logprobs: list[Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        calls = {"tool_calls": tool_calls} if tool_calls else {}
        if not self.parsed.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = ({"content": text} if text else {}) | calls
        else:
            choice["message"] = {"role": "assistant", "content": text} | calls
        choice |= {"logprobs": self._logprobs(logprobs or [], self._state(index)), "finish_reason": finish or None}
        if prompt_logprobs is not None and not self.parsed.chat:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt_logprobs)
        if self.parsed.return_token_ids:
            choice["token_ids"] = token_ids
            if not self.parsed.chat and not delta:
                choice["prompt_token_ids"] = self.prompts[index // self.n]
        return choice

    def _echoed(self, index: int, text: str, logprobs: list[Entry], prompt_lps: list[Logprob] | None) -> Any:
        """Echo: the choice's text and logprobs entries with its prompt's in front."""
        assert self.echo is not None
        p = index // self.n
        head = entries(self.prompts[p], prompt_lps) if self.wants_logprobs else []
        return prefixed(self.echo, text, logprobs, self.echo.texts[p], head)

    def _usage(self, heads: list[Any], completions: list[Any]) -> dict[str, Any]:
        """Each prompt once (its completion 0: ``heads``) and every completion's tokens."""
        generated = 0 if self.echo is not None and self.echo.only else sum(c.completion_tokens for c in completions)
        return usage(sum(h.prompt_tokens for h in heads), generated, sum(h.cached_tokens for h in heads))

    def body(self, done: list[Collected]) -> dict[str, Any]:
        """The non-streaming answer, from each completion gathered (by index)."""
        out = self._head("chat.completion" if self.parsed.chat else "text_completion")
        out["choices"] = []
        for i, d in enumerate(done):
            text, ids, finish = "".join(d.texts), d.token_ids, d.finish_reason
            lps: list[Entry] = list(d.logprobs)
            if self.echo is not None:
                text, lps = self._echoed(i, text, lps, done[i - i % self.n].prompt_logprobs)
                if self.echo.only:
                    ids, finish = [], "length"
            content: str | None = text
            calls = []
            if self.parsed.chat and self.tools is not None:
                content, found = read_all(self.tools, text)
                calls, finish = [c.openai() for c in found], finish_reason(finish, len(found))
            out["choices"].append(
                self._choice(
                    i,
                    content,
                    finish,
                    ids,
                    delta=False,
                    logprobs=lps,
                    prompt_logprobs=d.prompt_logprobs,
                    tool_calls=calls,
                )
            )
        prompt = done[0].prompt_logprobs
        if self.parsed.chat and prompt is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(prompt)  # vLLM: beside the choices
        out["usage"] = self._usage(done[:: self.n], done)
        if self.parsed.chat and self.parsed.return_token_ids:
            out["prompt_token_ids"] = self.prompts[0]
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
        """The stream chunks for one frontend chunk (none for tokens that are no text yet). With
        echo and logprobs, a choice waits for its prompt's logprobs (completion 0 brings them)."""
        p = chunk.index // self.n
        if chunk.prompt_logprobs is not None:
            self._prompt_lps[p] = chunk.prompt_logprobs
        out = self._events(chunk)
        if chunk.prompt_logprobs is not None:
            for i in range(p * self.n, (p + 1) * self.n):
                held, self._state(i).held = self._state(i).held, []
                for h in held:
                    out += self._events(h)
        return out

    @staticmethod
    def _calls(state: _Choice, chunk: Chunk) -> tuple[str, list[dict[str, Any]]]:
        """A chunk's content and the tool calls it completes (``delta.tool_calls``, indexed in the choice)."""
        if state.named is not None:
            deltas = state.named.deltas(chunk.text)
            state.calls = int(state.named.opened)
            return "", deltas
        assert state.reader is not None
        text, found = state.reader.feed(chunk.text)
        if chunk.finish_reason:
            rest, more = state.reader.finish()
            text, found = text + rest, found + more
        deltas = [c.delta(state.calls + k) for k, c in enumerate(found)]
        state.calls += len(found)
        return text, deltas

    def _events(self, chunk: Chunk) -> list[dict[str, Any]]:
        state = self._state(chunk.index)
        echo = self.echo
        if echo is not None and self.wants_logprobs and chunk.index // self.n not in self._prompt_lps:
            state.held.append(chunk)
            return []
        state.pending += chunk.logprobs or []
        if chunk.prompt_logprobs is not None:
            state.pending_prompt = chunk.prompt_logprobs
        text, token_ids, finish = chunk.text, chunk.token_ids, chunk.finish_reason
        calls: list[dict[str, Any]] = []
        if state.reader is not None:
            text, calls = self._calls(state, chunk)
            finish = finish_reason(finish, state.calls) if finish else finish
        if chunk.finish_reason:
            state.final = chunk
        elif echo is not None and echo.only:
            return []  # the prompt alone goes with the last chunk
        elif not text and not calls and not (self.parsed.return_token_ids and chunk.token_ids):
            return []  # its logprobs go with the next chunk that has text
        pending: list[Entry] = list(state.pending)
        state.pending = []
        prompt, state.pending_prompt = state.pending_prompt, None
        if echo is not None and not state.echoed:
            state.echoed = True
            text, pending = self._echoed(chunk.index, text, pending, self._prompt_lps.get(chunk.index // self.n))
        if echo is not None and echo.only:
            token_ids, finish = [], "length"
        out = self._chunk(
            [
                self._choice(
                    chunk.index,
                    text,
                    finish,
                    token_ids,
                    delta=True,
                    logprobs=pending,
                    prompt_logprobs=prompt,
                    tool_calls=calls or None,
                )
            ]
        )
        if self.parsed.chat and prompt is not None:
            out["prompt_logprobs"] = self._prompt_logprobs(prompt)
        return [out]

    def closing(self) -> list[dict[str, Any]]:
        """After the last chunk: the usage chunk, when ``stream_options.include_usage`` asked for it."""
        finals = {i: c.final for i, c in self._choices.items() if c.final is not None}
        if not self.parsed.include_usage or not finals:
            return []
        out = self._head("chat.completion.chunk" if self.parsed.chat else "text_completion")
        heads = [f for i, f in finals.items() if i % self.n == 0]
        return [out | {"choices": [], "usage": self._usage(heads, list(finals.values()))}]
