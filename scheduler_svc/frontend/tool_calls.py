"""Tool calling, the output side: the calls in a completion's text, whole or streamed (pure).

A ``Reader`` takes a completion's text piece by piece (``feed``, then ``finish``) and
returns, each time, the text that is content and the calls completed so far, so that a
stream and a whole answer (``read_all``: one feed) split the same text the same way:

- ``required``: the grammar's JSON array of ``{"name", "parameters"}``, held until the end
  (its calls come whole, in the last chunk); output cut short (``length``) that does not
  parse stays content.
- a named function: the grammar's JSON object is the call's arguments, whatever the text
  (cut short, too: as vLLM). A stream opens the call with the first text and sends the
  arguments as they come (``Named``), as OpenAI and vLLM stream them.
- ``auto`` with the ``hermes`` parser: each ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` is a call (an unclosed one at the end too, as vLLM reads it); text from
  ``<tool_call>`` on is held back until it is closed, so no tag leaks into content, and a
  block that is not such JSON is given back as content, tags included. Content is trimmed
  of surrounding whitespace (calls are separated by newlines), held back while only
  whitespace is pending.

Without ``parallel_tool_calls``, the first call only.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.frontend.tools import Plan

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_id)

    def openai(self) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls[i]``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict[str, Any]:
        """OpenAI's ``delta.tool_calls[i]`` of a call streamed whole."""
        return {"index": index} | self.openai()

    def to_pb(self) -> pb.ToolCall:
        return pb.ToolCall(id=self.id, name=self.name, arguments=self.arguments)


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def hermes_call(block: str) -> Call | None:
    """The call of one ``<tool_call>`` block's JSON, or None if it is not one."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], _dumps(args))


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass(slots=True)
class _Trim:
    """Content without surrounding whitespace, streamed: trailing whitespace is held back until more
    text follows it, leading whitespace dropped."""

    started: bool = False
    held: str = ""

    def __call__(self, text: str) -> str:
        text = self.held + text
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.held = text[len(body) :]
        self.started |= bool(body)
        return body


@dataclass(slots=True)
class Reader:
    """The calls and content of one completion's text, fed piece by piece (module docstring)."""

    plan: Plan
    buf: str = ""
    in_call: bool = False
    calls: int = 0  # calls returned so far
    trim: _Trim = field(default_factory=_Trim)

    def _keep(self, calls: list[Call]) -> list[Call]:
        if not self.plan.parallel:
            calls = calls[: max(0, 1 - self.calls)]
        self.calls += len(calls)
        return calls

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content and the calls that ``text`` completes."""
        self.buf += text
        if self.plan.mode != "auto":
            return "", []  # required, named: the whole JSON at the end
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.buf.find(CLOSE)
                if end < 0:
                    break
                block, self.buf, self.in_call = self.buf[:end], self.buf[end + len(CLOSE) :], False
                call = hermes_call(block)
                if call is None:
                    content += OPEN + block + CLOSE
                else:
                    calls.append(call)
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                content, self.buf, self.in_call = content + self.buf[:start], self.buf[start + len(OPEN) :], True
                continue
            cut = len(self.buf) - _partial(self.buf, OPEN)
            content, self.buf = content + self.buf[:cut], self.buf[cut:]
            break
        return self.trim(content), self._keep(calls)

    def finish(self) -> tuple[str, list[Call]]:
        """What is left once the completion has ended."""
        text, self.buf = self.buf, ""
        if self.plan.mode == "auto":
            call = hermes_call(text) if self.in_call else None
            if call is not None:
                return self.trim(""), self._keep([call])
            return self.trim((OPEN if self.in_call else "") + text), []
        calls = self._whole(text)
        if calls is None:
            return self.trim(text), []
        return "", self._keep(calls)

    def _whole(self, text: str) -> list[Call] | None:
        """required: the array's calls; named: the text is the arguments; None: no call."""
        if self.plan.mode == "named":
            return [Call(self.plan.function, text)] if text else None
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, list):
            return None
        calls = []
        for c in value:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                return None
            calls.append(Call(c["name"], _dumps(c.get("parameters", {}))))
        return calls


@dataclass(slots=True)
class Named:
    """A named function's call streamed: opened (id, name) with the first text, the arguments as they come."""

    function: str
    id: str = field(default_factory=new_id)
    opened: bool = False

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """OpenAI's ``delta.tool_calls`` for this much more of the arguments."""
        if not text:
            return []
        if self.opened:
            return [{"index": 0, "function": {"arguments": text}}]
        self.opened = True
        return [Call(self.function, text, self.id).delta(0)]


def reader(plan: Plan | None) -> Reader | None:
    """A reader of a completion's calls; None when none are read (no tools, or ``none``)."""
    return None if plan is None or plan.mode == "none" else Reader(plan)


def read_all(plan: Plan | None, text: str) -> tuple[str | None, list[Call]]:
    """A whole completion's content (None when it is empty and there are calls) and calls."""
    r = reader(plan)
    if r is None:
        return text, []
    content, calls = r.feed(text)
    rest, more = r.finish()
    content += rest
    calls += more
    return (content or None) if calls else content, calls


def finish_reason(reason: str, calls: int) -> str:
    """``tool_calls`` when a completion that stopped by itself made calls, as OpenAI and vLLM say."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass(slots=True)
class Texts:
    """The gRPC door: each completion's text gathered, its calls put on its last message."""

    plan: Plan | None
    texts: dict[int, list[str]] = field(default_factory=dict)

    def annotate(self, msg: pb.GenerateResponse) -> pb.GenerateResponse:
        if self.plan is None:
            return msg
        parts = self.texts.setdefault(msg.index, [])
        parts.append(msg.text)
        if msg.finish_reason:
            _, calls = read_all(self.plan, "".join(parts))
            msg.tool_calls.extend(c.to_pb() for c in calls)
        return msg
