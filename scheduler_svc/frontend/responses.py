"""OpenAI's Responses API (``/v1/responses``) as a chat completion: pure translations (no I/O).

A Responses request becomes the equivalent ``/v1/chat/completions`` body (``parse``,
then ``chat_body``), which the HTTP door runs through the chat path itself: one
validation, one chat template, one submission. The chat answer comes back as a
Response object (``answer``); a stream's chat chunks become Responses events in
``responses_stream``. A refusal the chat path words in chat's field names is renamed
to the Responses ones (``renamed``).

Tools travel in chat's shape (``{"type": "function", "function": {...}}``; Responses
writes them flat), ``function_call`` / ``function_call_output`` input items become an
assistant message with ``tool_calls`` and a ``tool`` message, and the chat answer's
``tool_calls`` become ``function_call`` output items. What the Responses API defines
and pagedserve does not honour is refused with a 400 naming it (``REFUSED``); unknown
fields are ignored, as vLLM and the chat path do. docs/http.md has the tables.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.frontend.openai_request import ApiError, bad

# Fields of a Responses request that pagedserve does not honour -> the values that mean "off"
# (accepted; null is always off). The OpenAI Agents SDK sends ``include: []`` on every call.
REFUSED: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "include": ([],),
    "reasoning": ({},),
    "truncation": ("disabled",),
    "conversation": (),
    "prompt": (),
    "max_tool_calls": (),
    "top_logprobs": (0,),
    "prompt_cache_key": (),
    "prompt_cache_retention": (),
    "context_management": (),
    "service_tier": ("auto", "default"),
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
# A refusal of the chat path names chat's field: the Responses name, by prefix (a regex).
RENAMES = (
    (r"max_tokens", "max_output_tokens"),
    (r"response_format\.json_schema", "text.format"),
    (r"response_format", "text.format"),
    (r"messages(\[\d+\])?", "input"),
    (r"tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"tool_choice\.function", "tool_choice"),
)


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them: ``resp_``, ``msg_``, ``fc_`` and hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class Call:
    """One Responses request: what the chat path is asked (``chat``, without the history's
    messages) and what the Response repeats (``echo``)."""

    chat: dict[str, Any]
    messages: list[dict[str, Any]]  # the input's messages, in chat's shape (not the instructions)
    echo: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None


def _off(v: Any, off: tuple[Any, ...]) -> bool:
    if isinstance(v, dict) and all(x is None for x in v.values()):
        v = {}
    return v is None or any(v == o and isinstance(v, bool) == isinstance(o, bool) for o in off)


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise bad(name, "must be a string")
    return v


def _optional(name: str, v: Any) -> str | None:
    return None if v is None else _str(name, v)


def _flag(name: str, v: Any, default: bool) -> bool:
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, "must be true or false")
    return v


def _text(name: str, content: Any) -> str | list[dict[str, Any]]:
    """A message's content: a string, or its text parts in chat's shape (which joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(name, "must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad(f"{name}[{j}].type", f"only {' and '.join(TEXT_PARTS)} parts are supported (not {kind!r})")
        parts.append({"type": "text", "text": _str(f"{name}[{j}].text", part.get("text"))})
    return parts


def _output(name: str, v: Any) -> str:
    """A function_call_output's output: a string, or text parts joined."""
    if isinstance(v, str):
        return v
    text = _text(name, v)
    return text if isinstance(text, str) else "\n".join(p["text"] for p in text)


def messages(items: Any, name: str = "input") -> list[dict[str, Any]]:
    """Responses input items (or a Response's output items) as chat messages. Consecutive
    ``function_call`` items are one assistant message's ``tool_calls`` (with the assistant text
    just before them, if any)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad(name, "must be a string or a list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}")
            out.append({"role": ROLES[role], "content": _text(f"{where}.content", item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": _str(f"{where}.call_id", item.get("call_id")),
                "type": "function",
                "function": {
                    "name": _str(f"{where}.name", item.get("name")),
                    "arguments": _str(f"{where}.arguments", item.get("arguments")),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _str(f"{where}.call_id", item.get("call_id")),
                    "content": _output(f"{where}.output", item.get("output")),
                }
            )
        else:
            raise bad(f"{where}.type", f"items of type {kind!r} are not supported")
    return out


def _tools(v: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools in chat's shape."""
    if not isinstance(v, list):
        raise bad("tools", "must be a list")
    out = []
    for i, tool in enumerate(v):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad(f"tools[{i}].type", f"only function tools are supported (not {kind!r})")
        fn = {"name": _str(f"tools[{i}].name", tool.get("name"))}
        fn |= {k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> str | dict[str, Any]:
    if v in ("none", "auto", "required"):
        return str(v)
    if isinstance(v, dict) and v.get("type") == "function":
        return {"type": "function", "function": {"name": _str("tool_choice.name", v.get("name"))}}
    raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')


def _format(v: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if not isinstance(v, dict):
        raise bad("text.format", "must be an object with a type")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad("text.format.type", "must be one of text, json_object, json_schema")
    spec = {k: v[k] for k in ("name", "schema", "strict", "description") if v.get(k) is not None}
    return {"type": "json_schema", "json_schema": spec}


def _text_config(v: Any) -> dict[str, Any] | None:
    if not isinstance(v, dict):
        raise bad("text", "must be an object")
    if v.get("verbosity") not in (None, "medium"):
        raise bad("text.verbosity", "not supported yet")
    return None if v.get("format") is None else _format(v["format"])


def parse(body: dict[str, Any]) -> Call:
    """The Responses request ``body`` as a chat-completion body and what its answer repeats;
    raises ApiError (a 400 naming the field)."""
    for name, off in REFUSED.items():
        if not _off(body.get(name), off):
            raise bad(name, "not supported yet")
    get = body.get
    chat: dict[str, Any] = {"model": get("model")}
    if get("max_output_tokens") is not None:
        chat["max_tokens"] = get("max_output_tokens")
    for name in ("temperature", "top_p"):
        if get(name) is not None:
            chat[name] = get(name)
    tools = _tools(get("tools")) if get("tools") is not None else []
    if tools:
        chat["tools"] = tools
        if get("parallel_tool_calls") is not None:  # without tools it changes nothing
            chat["parallel_tool_calls"] = get("parallel_tool_calls")
    if get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(get("tool_choice"))
    if get("text") is not None and (fmt := _text_config(get("text"))) is not None:
        chat["response_format"] = fmt
    stream = _flag("stream", get("stream"), False)
    if stream:
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    if (meta := get("metadata")) is not None and not isinstance(meta, dict):
        raise bad("metadata", "must be an object")
    instructions = _optional("instructions", get("instructions"))
    if get("input") is None:
        raise bad("input", "required")
    previous = _optional("previous_response_id", get("previous_response_id"))
    echo = {
        "instructions": instructions,
        "max_output_tokens": get("max_output_tokens"),
        "metadata": meta or {},
        "parallel_tool_calls": _flag("parallel_tool_calls", get("parallel_tool_calls"), True),
        "previous_response_id": previous,
        "temperature": get("temperature"),
        "text": get("text") or {"format": {"type": "text"}},
        "tool_choice": get("tool_choice") or "auto",
        "tools": get("tools") or [],
        "top_p": get("top_p"),
        "user": _optional("user", get("user")),
        "safety_identifier": _optional("safety_identifier", get("safety_identifier")),
    }
    return Call(chat, messages(get("input")), echo, stream, _flag("store", get("store"), True), previous)


def chat_body(call: Call, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completion body: the instructions as a system message, the previous response's
    conversation (``history``, never its instructions, as OpenAI), then this input."""
    instructions = call.echo.get("instructions")
    system = [] if instructions is None else [{"role": "system", "content": instructions}]
    return call.chat | {"messages": system + history + call.messages}


def renamed(err: ApiError) -> ApiError:
    """A chat-path refusal with its field (``param`` and the message's opening) in Responses' terms."""
    if err.param is None:
        return err
    param = err.param
    for old, new in RENAMES:
        param = re.sub(rf"^{old}(?=$|[.\[])", new, param)
    if param == err.param:
        return err
    message = param + err.message[len(err.param) :] if err.message.startswith(err.param) else err.message
    return ApiError(err.status, message, err.type, param, err.code, err.headers, err.extra)


# --- the answer ----------------------------------------------------------------


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's usage object in Responses' words."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},  # writes are not counted
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def status(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The Response's status and ``incomplete_details`` for the chat finish reason."""
    if finish_reason in ("stop", "tool_calls"):
        return "completed", None
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "incomplete", None  # abort: the request was stopped before it finished


def text_item(item_id: str, text: str, item_status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": item_status, "role": "assistant", "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, item_status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": item_status,
    }


def output(message: dict[str, Any], item_status: str, ids: Callable[[str], str] = new_id) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its text (a message item, also when the answer is
    empty and calls nothing), then a function_call item per tool call."""
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    items = [text_item(ids("msg"), text, item_status)] if text or not calls else []
    for c in calls:
        fn = c["function"]
        items.append(call_item(ids("fc"), c["id"], fn["name"], fn["arguments"], item_status))
    return items


def response(
    call: Call,
    response_id: str,
    created: int,
    model: str,
    items: list[dict[str, Any]],
    finish_reason: str | None,
    chat_usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The Response object: ``items`` and the request's settings; ``finish_reason`` None: in progress."""
    state, details = ("in_progress", None) if finish_reason is None else status(finish_reason)
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": state,
        "background": False,
        "error": None,
        "incomplete_details": details,
        "model": model,
        "output": items,
        "reasoning": None,
        "store": call.store,
        "truncation": "disabled",
        "usage": usage(chat_usage),
        **call.echo,
    }


def answer(call: Call, chat: dict[str, Any], response_id: str, ids: Callable[[str], str] = new_id) -> dict[str, Any]:
    """The Response to ``call`` from the chat path's (non-streamed) answer ``chat``."""
    choice = chat["choices"][0]
    state, _ = status(choice["finish_reason"])
    items = output(choice["message"], state, ids)
    return response(call, response_id, chat["created"], chat["model"], items, choice["finish_reason"], chat["usage"])


def conversation(call: Call, history: list[dict[str, Any]], answered: dict[str, Any]) -> list[dict[str, Any]]:
    """What a follow-up's ``previous_response_id`` continues: the history, this input and the answer
    (its output items as chat messages), without the instructions."""
    return history + call.messages + messages(answered["output"], "output")
