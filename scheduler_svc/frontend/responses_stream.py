"""A Responses stream from the chat path's stream: chat chunks in, Responses events out (pure).

``Events`` reads the chat completion chunks of one answer (``openai_response.Shape``'s,
with the usage chunk at the end) and writes the events OpenAI's Responses stream has,
each with the next ``sequence_number``: ``response.created`` and ``response.in_progress``;
per output item ``response.output_item.added``, its deltas (``response.content_part.added``
and ``response.output_text.delta`` for text, ``response.function_call_arguments.delta``
for a tool call) and their ``.done`` events, ``response.output_item.done``; then
``response.completed``, or ``response.incomplete`` when the answer stopped at
``max_output_tokens`` (as OpenAI), with the whole Response, the same as the
non-streamed answer's (``responses.response``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.frontend.openai_request import ApiError
from scheduler_svc.frontend.responses import Call, call_item, new_id, response, status, text_item

Event = dict[str, Any]


def encode(event: Event) -> bytes:
    """One server-sent event: its type as ``event:``, the event as ``data:``."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


@dataclass(slots=True)
class _Open:
    """The output item being streamed: a message's text, or a function call's arguments."""

    item: Event  # as ``response.output_item.added`` showed it
    text: str = ""  # the text or arguments so far
    tool_index: int | None = None  # chat's index of the tool call


@dataclass(slots=True)
class Events:
    call: Call
    response_id: str
    created: int
    model: str
    ids: Callable[[str], str] = new_id
    seq: int = 0
    items: list[Event] = field(default_factory=list)  # output items done
    current: _Open | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def response(self) -> Event:
        """The Response as it stands (in progress until the chat stream has finished)."""
        return response(
            self.call, self.response_id, self.created, self.model, list(self.items), self.finish_reason, self.usage
        )

    def opening(self) -> list[Event]:
        r = self.response()
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def feed(self, chunk: Event) -> list[Event]:
        """The events of one chat chunk."""
        out: list[Event] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for tool_call in delta.get("tool_calls") or []:
                out += self._tool_call(tool_call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def closing(self) -> list[Event]:
        """After the chat stream: the open item done (an empty message if there was none), and the
        final ``response.completed`` (or ``response.incomplete``)."""
        self.finish_reason = self.finish_reason or "abort"
        out = self._close()
        if not self.items:
            out += self._text("") + self._close()
        state, _ = status(self.finish_reason)
        kind = "response.completed" if state == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self.response())]

    def error(self, err: ApiError) -> Event:
        """The stream cannot go on: OpenAI's error event (it ends the stream)."""
        return self._event("error", code=err.code, message=err.message, param=err.param)

    def _where(self) -> dict[str, Any]:
        assert self.current is not None
        return {"item_id": self.current.item["id"], "output_index": len(self.items)}

    def _text(self, delta: str) -> list[Event]:
        out: list[Event] = []
        if self.current is None or self.current.item["type"] != "message":
            out += self._close()
            item = text_item(self.ids("msg"), "", "in_progress") | {"content": []}
            self.current = _Open(item)
            out.append(self._event("response.output_item.added", output_index=len(self.items), item=item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        if delta:
            self.current.text += delta
            out.append(
                self._event("response.output_text.delta", **self._where(), content_index=0, delta=delta, logprobs=[])
            )
        return out

    def _tool_call(self, delta: Event) -> list[Event]:
        out: list[Event] = []
        fn = delta.get("function") or {}
        if self.current is None or self.current.tool_index != delta.get("index", 0):
            out += self._close()
            item = call_item(self.ids("fc"), delta.get("id") or "", fn.get("name") or "", "", "in_progress")
            self.current = _Open(item, tool_index=delta.get("index", 0))
            out.append(self._event("response.output_item.added", output_index=len(self.items), item=item))
        if fn.get("arguments"):
            self.current.text += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=fn["arguments"]))
        return out

    def _close(self) -> list[Event]:
        """The open item's ``.done`` events; it joins ``items``."""
        if (now := self.current) is None:
            return []
        where = self._where()
        state = status(self.finish_reason)[0] if self.finish_reason else "completed"
        item, text = now.item, now.text
        if item["type"] == "message":
            done = text_item(item["id"], text, state)
            part = done["content"][0]
            out = [
                self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            done = call_item(item["id"], item["call_id"], item["name"], text, state)
            out = [self._event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)]
        out.append(self._event("response.output_item.done", output_index=len(self.items), item=done))
        self.items.append(done)
        self.current = None
        return out
