"""Tool calling, the request side: pure functions on plain data (no I/O).

OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (``from_openai``: the HTTP
body's JSON into pagedserve.v1's ``Tool``/``ToolChoice``), checked into a ``Plan``
(``plan``, for both doors): what the chat template is given, and how the output is read.

- ``required`` and a named function are enforced by a grammar, as vLLM does: for
  ``required`` a JSON array of ``{"name": <a tool's name>, "parameters": <its schema>}``
  objects (one at most unless ``parallel_tool_calls``), for a named function that
  function's parameters schema; any model then answers with calls.
- ``auto`` reads the calls from the text with the scheduler's ``--tool-call-parser``
  (``tool_calls``), refused without one as vLLM refuses it without
  ``--enable-auto-tool-choice``.
- ``none`` renders the tools but reads no call (vLLM's default).

A chat template that never mentions ``tools`` (SmolLM2's) cannot show them to the model:
``template_messages`` then writes them into a Hermes-style system prompt (Qwen2.5's
words) and renders earlier calls and tool results as ``<tool_call>``/``<tool_response>``
text, the format the ``hermes`` parser reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.frontend.refusals import InvalidArgument

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
PARSERS = ("hermes",)  # --tool-call-parser
MODES = {"none": pb.ToolChoice.NONE, "auto": pb.ToolChoice.AUTO, "required": pb.ToolChoice.REQUIRED}
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
AUTO_NEEDS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
HERMES_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


# pagedserve.v1's names of the fields a refusal names -> OpenAI's.
OPENAI_NAMES = (
    (re.compile(r"^(tools\[\d+\])\.name"), r"\1.function.name"),
    (re.compile(r"^(tools\[\d+\])\.parameters_json_schema"), r"\1.function.parameters"),
    (re.compile(r"^(messages\[\d+\]\.tool_calls\[\d+\])\.(name|arguments)"), r"\1.function.\2"),
)


def openai_name(field: str) -> str:
    """A tool field as OpenAI's request names it (``tools[0].name`` is ``tools[0].function.name``)."""
    for pattern, name in OPENAI_NAMES:
        field = pattern.sub(name, field)
    return field


@dataclass(frozen=True, slots=True)
class Plan:
    """A request's tools, checked: ``mode`` is none, auto, required or named (``function``).
    ``tools``: as chat templates take them (OpenAI's shape); ``schema``: the grammar of
    required and named (JSON text), else None; ``parser``: auto's."""

    mode: str
    tools: tuple[dict[str, Any], ...] = ()
    function: str = ""
    parallel: bool = True
    parser: str = ""
    schema: str | None = None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parameters(i: int, tool: pb.Tool) -> dict[str, Any]:
    if not tool.parameters_json_schema:
        return dict(NO_PARAMETERS)
    name = f"tools[{i}].parameters_json_schema"
    try:
        params = json.loads(tool.parameters_json_schema, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(name, f"not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise InvalidArgument(name, "must be a JSON schema (an object)")
    return params


def _tool(i: int, tool: pb.Tool) -> dict[str, Any]:
    if not NAME.fullmatch(tool.name):
        raise InvalidArgument(f"tools[{i}].name", "must be 1 to 64 letters, digits, '_' or '-'")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = _parameters(i, tool)
    return {"type": "function", "function": function}


def _mode(req: pb.GenerateRequest) -> tuple[str, str]:
    """(mode, named function); unset: auto with tools, none without (OpenAI's defaults)."""
    choice = req.tool_choice
    kind = choice.WhichOneof("choice") if req.HasField("tool_choice") else None
    if kind == "function_name":
        return "named", choice.function_name
    if kind is None or choice.mode == pb.ToolChoice.MODE_UNSPECIFIED:
        return ("auto" if req.tools else "none"), ""
    names = {v: k for k, v in MODES.items()}
    if choice.mode not in names:
        raise InvalidArgument("tool_choice", f"unknown mode {choice.mode}")
    return names[choice.mode], ""


def _hoisted(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Each tool's ``$defs`` moved to the root of the combined schema, where their ``#/$defs/...``
    references (pydantic's) point once the parameters are nested in it (as vLLM does)."""
    defs: dict[str, Any] = {}
    for i, t in enumerate(tools):
        params = t["function"]["parameters"]
        for name, d in params.get("$defs", {}).items():
            if name in defs and defs[name] != d:
                raise InvalidArgument(f"tools[{i}].parameters.$defs.{name}", "differs from another tool's of that name")
            defs[name] = d
    return defs


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's grammar of ``tool_choice: required``: a list of calls, each a tool's name and its parameters."""

    def one(t: dict[str, Any]) -> dict[str, Any]:
        params = {k: v for k, v in t["function"]["parameters"].items() if k != "$defs"}
        return {
            "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": params},
            "required": ["name", "parameters"],
        }

    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [one(t) for t in tools]},
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs := _hoisted(tools):
        schema["$defs"] = defs
    return schema


def plan(req: pb.GenerateRequest, parser: str = "") -> Plan | None:
    """The request's tools checked, or None when it has neither tools nor a tool choice that asks
    for one. ``parser``: the scheduler's --tool-call-parser ("" : ``auto`` is refused)."""
    mode, function = _mode(req)
    if not req.tools:
        if mode in ("required", "named"):
            raise InvalidArgument("tool_choice", f"{mode if mode == 'required' else 'a named function'} needs tools")
        return None
    if not req.messages:
        raise InvalidArgument("tools", "only with messages (the chat template renders them)")
    tools = [_tool(i, t) for i, t in enumerate(req.tools)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidArgument("tools", "two tools have the same name")
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
    schema = None
    if mode == "auto" and not parser:
        raise InvalidArgument("tool_choice", AUTO_NEEDS)
    if mode == "required":
        schema = json.dumps(required_schema(tools, parallel), ensure_ascii=False)
    elif mode == "named":
        if function not in names:
            raise InvalidArgument("tool_choice", f"no tool is named {function!r}")
        schema = json.dumps(tools[names.index(function)]["function"]["parameters"], ensure_ascii=False)
    return Plan(mode, tuple(tools), function, parallel, parser if mode == "auto" else "", schema)


# --- the HTTP body ----------------------------------------------------------------


def _schema_text(name: str, v: Any) -> str:
    if not isinstance(v, dict):
        raise InvalidArgument(name, "must be a JSON schema (an object)")
    try:
        return json.dumps(v, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(name, f"not representable as JSON: {exc}") from None


def _string(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise InvalidArgument(name, "must be a string")
    return v


def _openai_tool(i: int, t: Any) -> pb.Tool:
    name = f"tools[{i}]"
    if not isinstance(t, dict):
        raise InvalidArgument(name, 'must be an object {"type": "function", "function": {...}}')
    if t.get("type", "function") != "function":
        raise InvalidArgument(f"{name}.type", 'only "function" tools are supported')
    f = t.get("function")
    if not isinstance(f, dict):
        raise InvalidArgument(f"{name}.function", "must be an object with a name")
    tool = pb.Tool(name=_string(f"{name}.function.name", f.get("name")))
    if f.get("description") is not None:
        tool.description = _string(f"{name}.function.description", f["description"])
    if f.get("parameters") is not None:
        tool.parameters_json_schema = _schema_text(f"{name}.function.parameters", f["parameters"])
    return tool


def _openai_choice(v: Any) -> pb.ToolChoice:
    if isinstance(v, str):
        if v not in MODES:
            raise InvalidArgument("tool_choice", f"must be one of {', '.join(MODES)} or a function")
        return pb.ToolChoice(mode=MODES[v])
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        return pb.ToolChoice(function_name=_string("tool_choice.function.name", v["function"].get("name")))
    raise InvalidArgument("tool_choice", 'must be none, auto, required or {"type": "function", "function": {"name"}}')


def from_openai(req: pb.GenerateRequest, body: dict[str, Any]) -> None:
    """The body's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` into ``req``."""
    if (tools := body.get("tools")) is not None:
        if not isinstance(tools, list):
            raise InvalidArgument("tools", "must be a list of tools")
        req.tools.extend(_openai_tool(i, t) for i, t in enumerate(tools))
    if (choice := body.get("tool_choice")) is not None:
        req.tool_choice.CopyFrom(_openai_choice(choice))
    if (parallel := body.get("parallel_tool_calls")) is not None:
        if not isinstance(parallel, bool):
            raise InvalidArgument("parallel_tool_calls", "must be true or false")
        req.parallel_tool_calls = parallel


def message_fields(i: int, m: dict[str, Any], msg: pb.ChatMessage) -> None:
    """An OpenAI message's ``tool_calls``, ``tool_call_id`` and ``name`` into ``msg``."""
    if (calls := m.get("tool_calls")) is not None:
        if not isinstance(calls, list):
            raise InvalidArgument(f"messages[{i}].tool_calls", "must be a list")
        for j, c in enumerate(calls):
            name = f"messages[{i}].tool_calls[{j}]"
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict):
                raise InvalidArgument(f"{name}.function", "must be an object with name and arguments")
            args = f.get("arguments", "{}")
            if isinstance(args, dict):  # some clients send the object itself
                args = json.dumps(args, ensure_ascii=False)
            msg.tool_calls.append(
                pb.ToolCall(
                    id=_string(f"{name}.id", c.get("id") or ""),
                    name=_string(f"{name}.function.name", f.get("name")),
                    arguments=_string(f"{name}.function.arguments", args),
                )
            )
    if m.get("tool_call_id") is not None:
        msg.tool_call_id = _string(f"messages[{i}].tool_call_id", m["tool_call_id"])
    if m.get("name") is not None:
        msg.name = _string(f"messages[{i}].name", m["name"])


# --- the chat template --------------------------------------------------------------


def renders_tools(template: Any) -> bool:
    """Whether a chat template (its text, or a dict of named ones) shows tools to the model."""
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and "tools" in t for t in texts)


def _arguments(field: str, text: str) -> Any:
    """A call's arguments as templates take them (an object, as vLLM passes them)."""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        raise InvalidArgument(field, "must be JSON text") from None


def _hermes_call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def template_messages(
    req: pb.GenerateRequest, p: Plan | None, aware: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and ``tools``) to give the chat template; ``aware``: it renders tools itself,
    else the Hermes-style prompt and text stand in (module docstring)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        calls = [
            (c.id, c.name, _arguments(f"messages[{i}].tool_calls[{j}].arguments", c.arguments))
            for j, c in enumerate(m.tool_calls)
        ]
        if calls and aware:
            d["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for cid, name, args in calls
            ]
        elif calls:
            d["content"] = "\n".join([m.content] * bool(m.content) + [_hermes_call(n, a) for _, n, a in calls])
        if m.role == "tool" and not aware:
            d["content"] = f"<tool_response>\n{m.content}\n</tool_response>"
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    if p is None:
        return out, None
    if aware:
        return out, list(p.tools)
    prompt = HERMES_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in p.tools))
    if out and out[0]["role"] == "system":
        out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None
