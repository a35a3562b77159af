"""OpenAI's request JSON to pagedserve.v1, and the frontend's errors to OpenAI's: pure functions (no I/O).

``parse`` turns the body of ``/v1/completions`` or ``/v1/chat/completions`` into a
``pb.GenerateRequest`` (what the gRPC API takes, checked afterwards by the same
``Frontend.prepare``); ``error_for`` turns the frontend's refusals into an HTTP
status and OpenAI's error object, through ``refusals.TABLE`` as the gRPC servicer.
The answers are built by ``openai_response``. docs/http.md has the tables.

Only the JSON types are checked here, and what pagedserve.v1 cannot represent
(ranges of its integer types, float32, lone surrogates); the values themselves are
checked by ``validate.check`` as for gRPC, and a refusal's field is renamed to the
OpenAI one (``sampling.max_tokens`` becomes ``max_tokens``: ``openai_field``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.frontend import refusals, tools
from scheduler_svc.frontend.refusals import TABLE, InvalidArgument, Kind, Refusal, StreamDetached
from scheduler_svc.frontend.validate import Limits, check_request_id

U32, I32, U64 = (1 << 32) - 1, (1 << 31) - 1, (1 << 64) - 1
FLOAT32_MAX = 3.4028234663852886e38
# Fields OpenAI or vLLM define that pagedserve does not honour: refused with a 400 naming
# them, never ignored. Each maps to the values that mean "off", which are accepted (null is
# always off). tests/test_http.py walks vLLM's request fields against this table.
NOT_YET: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "functions": ([],),  # OpenAI's deprecated form of tools
    "use_beam_search": (False,),
    "length_penalty": (1.0,),  # beam search's
    "watermarking": (False,),
    "reasoning_effort": (),
    "thinking_token_budget": (-1,),
    "include_reasoning": (True,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncation_side": ("left",),  # vLLM's tokenizers truncate on the left: truncate_prompt_tokens keeps the last
    "logprob_token_ids": (),
    "documents": ([],),
    "chat_template": (),
    "media_io_kwargs": ({},),
    "mm_processor_kwargs": ({},),
    "prompt_embeds": (),
    "session_id": (),
    "return_tokens_as_token_ids": (False,),
    "routed_experts_prompt_start": (0,),
    "return_token_offsets": (False,),
    "return_prompt_text": (False,),
    "return_mm_kwargs": (True,),
    "kv_transfer_params": ({},),
    "ec_transfer_params": ({},),
    "vllm_xargs": ({},),
    "repetition_detection": (),
    "stream_interval": (1,),  # every step's tokens are streamed as they come
    "logits_processors": ([],),
}
# Chat's (tools.from_openai); on /v1/completions only their off values.
TOOL_FIELDS: dict[str, tuple[Any, ...]] = {"tools": (None, []), "tool_choice": (None, "none", "auto")}
# add_special_tokens: each endpoint's default is what pagedserve does (chat: the template adds them).
ADD_SPECIAL_TOKENS = {True: False, False: True}  # chat -> the value honoured
# vLLM's structured-output keys (``structured_outputs: {...}``, and the older top-level
# ``guided_*``) -> the StructuredOutput field they set.
STRUCTURED_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
GUIDED = {f"guided_{k}": v for k, v in STRUCTURED_KEYS.items() if k != "json_object"}
STRUCTURED_FIELD = "sampling.structured_output."  # how validate/frontend name its fields
# A refusal's field is pagedserve.v1's name; OpenAI's names for those that differ, by prefix.
RENAMES = {"sampling.": "", "prompt_token_ids": "prompt", "request_id": "X-Request-Id"}


class ApiError(Exception):
    """An HTTP error answer: ``status`` and OpenAI's ``{"error": {...}}`` object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.extra}
        }


def refused(
    kind: Kind,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> ApiError:
    """The HTTP answer to a refusal of ``kind``: status, ``type``, ``code`` and headers from ``refusals.TABLE``."""
    row = TABLE[kind]
    return ApiError(row.http_status, message, row.type, param, row.code, dict(row.headers) | (headers or {}), extra)


def bad(name: str, what: str) -> ApiError:
    return refused(Kind.INVALID_ARGUMENT, f"{name}: {what}", param=name)


def openai_field(field: str | None) -> str | None:
    """A pagedserve.v1 field as OpenAI's request names it (``sampling.stop[1]`` is ``stop[1]``)."""
    if field is None:
        return None
    for old, new in RENAMES.items():
        if field.startswith(old):
            return new + field[len(old) :]
    return tools.openai_name(field)


def api_error(refusal: Refusal) -> ApiError:
    """A refusal as OpenAI's error: its field as ``param``, its retry hint as ``Retry-After``, and
    where to resume a detached stream (gRPC ``Resume``) beside the message."""
    param = openai_field(refusal.field)
    headers = {} if refusal.retry_after is None else {"Retry-After": str(refusal.retry_after)}
    extra = None
    if isinstance(refusal, StreamDetached):
        extra = {"request_id": refusal.request_id, "offset": refusal.offset}
    return refused(refusal.kind, refusal.openai_message(param), param, headers, extra)


def error_for(exc: BaseException) -> ApiError | None:
    """The HTTP answer to an exception of ``Frontend.prepare``/``generate``; None: not one of theirs."""
    if isinstance(exc, ApiError):
        return exc
    refusal = refusals.of(exc)
    return None if refusal is None else api_error(refusal)


# --- reading JSON ----------------------------------------------------------------


def _integer(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, "must be an integer")
    if not lo <= v <= hi:
        raise bad(name, f"must be between {lo} and {hi}")
    return v


def _number(name: str, v: Any) -> float:
    """A finite float that a float32 holds (pagedserve.v1's sampling floats)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(name, "must be a number")
    if not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
        raise bad(name, "must be a finite number")
    return float(v)


def _text(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise bad(name, "must be a string")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(name, "must be valid Unicode (no lone surrogates)") from None
    return v


def _flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise bad(name, "must be true or false")
    return v


def _ints(name: str, v: Any, hi: int) -> list[int]:
    if not isinstance(v, list):
        raise bad(name, "must be a list of integers")
    return [_integer(f"{name}[{i}]", x, 0, hi) for i, x in enumerate(v)]


def _stops(v: Any) -> list[str]:
    if isinstance(v, str):
        return [_text("stop", v)]
    if not isinstance(v, list):
        raise bad("stop", "must be a string or a list of strings")
    return [_text(f"stop[{i}]", x) for i, x in enumerate(v)]


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    for name, off in NOT_YET.items():
        v = body.get(name)
        if v is not None and not any(v == o and isinstance(v, bool) == isinstance(o, bool) for o in off):
            raise bad(name, "not supported yet")
    if body.get("add_special_tokens") not in (None, ADD_SPECIAL_TOKENS[chat]):
        raise bad("add_special_tokens", f"only {str(ADD_SPECIAL_TOKENS[chat]).lower()} is supported on this endpoint")
    if (best_of := body.get("best_of")) is not None:
        n = body.get("n") if body.get("n") is not None else 1
        if _integer("best_of", best_of, 1, U32) != n:
            raise bad("best_of", f"only best_of equal to n ({n}) is supported: no ranking of extra completions")


def _sampling(body: dict[str, Any], chat: bool) -> pb.SamplingParams:
    s = pb.SamplingParams()
    get = body.get
    name = "max_completion_tokens" if chat and get("max_completion_tokens") is not None else "max_tokens"
    if get(name) is not None:
        s.max_tokens = _integer(name, get(name), 1, U32)
    for name in ("temperature", "top_p"):
        if get(name) is not None:
            setattr(s, name, _number(name, get(name)))
    if (top_k := get("top_k")) is not None and (top_k := _integer("top_k", top_k, -1, I32)) != -1:
        s.top_k = top_k  # vLLM's -1 (like 0) means off
    if get("seed") is not None:
        s.seed = _integer("seed", get("seed"), 0, U64)
    if get("n") is not None:  # its range is --max-n's (the frontend's check)
        s.n = _integer("n", get("n"), 0, U32)
    if get("stop") is not None:
        s.stop.extend(_stops(get("stop")))
    if get("stop_token_ids") is not None:
        s.stop_token_ids.extend(_ints("stop_token_ids", get("stop_token_ids"), U32))
    if get("ignore_eos") is not None:
        s.ignore_eos = _flag("ignore_eos", get("ignore_eos"))
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if get(name) is not None:
            setattr(s, name, _number(name, get(name)))
    if get("min_tokens") is not None:
        s.min_tokens = _integer("min_tokens", get("min_tokens"), 0, U32)
    if get("logit_bias") is not None:
        s.logit_bias.update(_logit_bias(get("logit_bias")))
    if get("include_stop_str_in_output") is not None:
        s.include_stop_str_in_output = _flag("include_stop_str_in_output", get("include_stop_str_in_output"))
    if get("allowed_token_ids") is not None:
        if not (allowed := _ints("allowed_token_ids", get("allowed_token_ids"), U32)):
            raise bad("allowed_token_ids", "must not be empty (leave it out to allow every token)")
        s.allowed_token_ids.extend(allowed)
    if get("bad_words") is not None:
        words = get("bad_words")
        if not isinstance(words, list):
            raise bad("bad_words", "must be a list of strings")
        s.bad_words.extend(_text(f"bad_words[{i}]", w) for i, w in enumerate(words))
    _logprobs(s, body, chat)
    return s


def _logit_bias(v: Any) -> dict[int, float]:
    """OpenAI's map of token ids (JSON object keys, so strings) to biases."""
    if not isinstance(v, dict):
        raise bad("logit_bias", "must be an object mapping token ids to numbers")
    out = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) <= U32):
            raise bad("logit_bias", f"key {k!r} is not a token id")
        out[int(k)] = _number(f"logit_bias[{k}]", b)
    return out


def _logprobs(s: pb.SamplingParams, body: dict[str, Any], chat: bool) -> None:
    """Completions: ``logprobs`` is how many alternatives; chat: ``logprobs`` a flag and
    ``top_logprobs`` how many. ``prompt_logprobs`` is vLLM's extension, on both."""
    get = body.get
    if chat:
        wanted = get("logprobs") is not None and _flag("logprobs", get("logprobs"))
        if get("top_logprobs") is not None:
            top = _integer("top_logprobs", get("top_logprobs"), 0, U32)
            if not wanted and top:
                raise bad("top_logprobs", "needs logprobs: true")
            if wanted:
                s.logprobs = top
        elif wanted:
            s.logprobs = 0
    elif get("logprobs") is not None:
        s.logprobs = _integer("logprobs", get("logprobs"), 0, U32)
    if get("prompt_logprobs") is not None:
        s.prompt_logprobs = _integer("prompt_logprobs", get("prompt_logprobs"), 0, U32)


def _schema(name: str, v: Any) -> str:
    """A JSON schema given as an object (or, as vLLM takes it, as JSON text)."""
    if isinstance(v, str):
        return _text(name, v)
    if not isinstance(v, dict):
        raise bad(name, "must be a JSON schema (an object)")
    return json.dumps(v, ensure_ascii=False)


def _set_structured(so: pb.StructuredOutput, kind: str, name: str, v: Any) -> None:
    if kind == "json_schema":
        so.json_schema = _schema(name, v)
    elif kind == "choice":
        if not isinstance(v, list) or not v:
            raise bad(name, "must be a non-empty list of strings")
        so.choice.choices.extend(_text(f"{name}[{i}]", x) for i, x in enumerate(v))
    elif kind == "json_object":
        if not _flag(name, v):
            raise bad(name, "must be true when given")
        so.json_object = True
    else:
        setattr(so, kind, _text(name, v))


def _response_format(v: Any) -> tuple[pb.StructuredOutput, str] | None:
    """OpenAI's ``response_format``: text (no constraint), json_object, json_schema."""
    if not isinstance(v, dict):
        raise bad("response_format", "must be an object with a type")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True), "response_format"
    if kind != "json_schema":
        raise bad("response_format.type", "must be one of text, json_object, json_schema")
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "must be an object with name and schema")
    _text("response_format.json_schema.name", spec.get("name"))
    if spec.get("schema") is None:
        raise bad("response_format.json_schema.schema", "required")
    return (
        pb.StructuredOutput(json_schema=_schema("response_format.json_schema.schema", spec["schema"])),
        "response_format.json_schema.schema",
    )


def _structured(body: dict[str, Any]) -> tuple[pb.StructuredOutput, str] | None:
    """The constraint of ``response_format``, vLLM's ``structured_outputs`` or its ``guided_*``
    fields (at most one of them), and the HTTP field that holds it."""
    found: list[tuple[pb.StructuredOutput, str]] = []
    if body.get("response_format") is not None:
        if (got := _response_format(body["response_format"])) is not None:
            found.append(got)
    if (v := body.get("structured_outputs")) is not None:
        if not isinstance(v, dict):
            raise bad("structured_outputs", "must be an object")
        for key, value in v.items():
            if value is None or key not in STRUCTURED_KEYS:
                continue  # vLLM's other options (backend, whitespace...) do not change what is allowed
            so, name = pb.StructuredOutput(), f"structured_outputs.{key}"
            _set_structured(so, STRUCTURED_KEYS[key], name, value)
            found.append((so, name))
    for key, kind in GUIDED.items():
        if body.get(key) is not None:
            so = pb.StructuredOutput()
            _set_structured(so, kind, key, body[key])
            found.append((so, key))
    if len(found) > 1:
        raise bad(found[1][1], f"only one structured-output constraint per request (also given: {found[0][1]})")
    return found[0] if found else None


def structured_error(exc: Refusal, parsed: Parsed) -> ApiError | None:
    """A refused spec (it does not compile, or is too large), named as the request named it."""
    if not parsed.structured_param or not (exc.field or "").startswith(STRUCTURED_FIELD):
        return None
    return bad(parsed.structured_param, exc.reason)


def _prompt(req: pb.GenerateRequest, v: Any) -> None:
    """A string, token ids, or a list of exactly one of either (the door splits a batch into its
    prompts first: ``batch.prompts``)."""
    if isinstance(v, list) and v and all(isinstance(x, str | list) for x in v):
        if len(v) != 1:
            raise bad("prompt", f"{len(v)} prompts: parse takes one (batch.prompts splits a batch)")
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise bad("prompt", "must not be empty")
        req.prompt = _text("prompt", v)
    elif isinstance(v, list) and v:
        req.prompt_token_ids.extend(_ints("prompt", v, U32))
    else:
        raise bad("prompt", "must be a non-empty string or list of token ids")


def _content(i: int, v: Any) -> str:
    """A message's content: a string, or text parts joined with newlines (as vLLM joins them)."""
    name = f"messages[{i}].content"
    if v is None:
        return ""
    if isinstance(v, str):
        return _text(name, v)
    if not isinstance(v, list):
        raise bad(name, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad(f"{name}[{j}]", 'only parts of type "text" are supported')
        texts.append(_text(f"{name}[{j}].text", part.get("text")))
    return "\n".join(texts)


def _messages(req: pb.GenerateRequest, v: Any) -> None:
    if not isinstance(v, list) or not v:
        raise bad("messages", "must be a non-empty list of messages")
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        msg = pb.ChatMessage(role=_text(f"messages[{i}].role", m.get("role")), content=_content(i, m.get("content")))
        tools.message_fields(i, m, msg)
        req.messages.append(msg)


@dataclass(frozen=True, slots=True)
class Parsed:
    """One OpenAI request: the pagedserve.v1 request and how to answer it."""

    request: pb.GenerateRequest
    model: str
    chat: bool
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: token ids in the choices
    structured_param: str = ""  # the field that set sampling.structured_output (errors name it)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("stream_options", "only allowed when stream is true")
    if not isinstance(opts, dict):
        raise bad("stream_options", "must be an object")
    return opts.get("include_usage") is not None and _flag("stream_options.include_usage", opts["include_usage"])


def _request_id(body: dict[str, Any], header: str) -> str:
    """The body's request_id (vLLM's) or the X-Request-Id header; both: they must agree."""
    header = _text("X-Request-Id", header)
    if body.get("request_id") is None:
        return header
    rid = _text("request_id", body["request_id"])
    if header and rid != header:
        raise bad("request_id", f"differs from the X-Request-Id header ({header!r}); send one, or the same in both")
    try:
        check_request_id(rid)
    except InvalidArgument as exc:
        raise bad("request_id", exc.reason) from None
    return rid


def _chat_template(req: pb.GenerateRequest, body: dict[str, Any]) -> None:
    """vLLM's chat-template fields (checked together by ``chat_template.settings``)."""
    if body.get("add_generation_prompt") is not None:
        req.add_generation_prompt = _flag("add_generation_prompt", body["add_generation_prompt"])
    if body.get("continue_final_message") is not None:
        req.continue_final_message = _flag("continue_final_message", body["continue_final_message"])
    if (kwargs := body.get("chat_template_kwargs")) is not None:
        if not isinstance(kwargs, dict):
            raise bad("chat_template_kwargs", "must be an object")
        try:
            json_format.ParseDict(kwargs, req.chat_template_kwargs)
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
            raise bad("chat_template_kwargs", f"not representable: {exc}") from None


def parse(body: dict[str, Any], chat: bool, request_id: str = "") -> Parsed:
    """The request of a completion (``chat`` False) or chat completion body; raises ApiError.
    ``request_id``: the X-Request-Id header."""
    if body.get("model") is None:
        raise bad("model", "required")
    model = _text("model", body["model"])
    _refuse_unsupported(body, chat)
    req = pb.GenerateRequest(request_id=_request_id(body, request_id), sampling=_sampling(body, chat))
    structured = _structured(body)
    if structured is not None:
        req.sampling.structured_output.CopyFrom(structured[0])
    if chat:
        try:
            _messages(req, body.get("messages"))
            tools.from_openai(req, body)
        except InvalidArgument as exc:  # tools' own checks, named as the body names them
            raise api_error(exc) from None
        _chat_template(req, body)
    else:
        for name, off in TOOL_FIELDS.items():
            if body.get(name) not in off:
                raise bad(name, "only on /v1/chat/completions")
        _prompt(req, body.get("prompt"))
    if body.get("priority") is not None:
        req.priority = _integer("priority", body["priority"], -I32 - 1, I32)
    if body.get("queue_timeout") is not None:
        req.queue_timeout = _number("queue_timeout", body["queue_timeout"])
    if body.get("cache_salt") is not None:  # vLLM's extra body field: prefix-cache isolation
        req.cache_salt = _text("cache_salt", body["cache_salt"])
    if body.get("truncate_prompt_tokens") is not None:
        req.truncate_prompt_tokens = _integer("truncate_prompt_tokens", body["truncate_prompt_tokens"], -I32 - 1, I32)
    stream = body.get("stream") is not None and _flag("stream", body["stream"])
    ids = body.get("return_token_ids") is not None and _flag("return_token_ids", body["return_token_ids"])
    return Parsed(
        req, model, chat, stream, _stream_options(body, stream), ids, structured[1] if structured is not None else ""
    )


def context_room(limits: Limits, num_prompt: int) -> int:
    """The most tokens a prompt of ``num_prompt`` tokens can be followed by on some executor:
    to the end of its context, as far as its KV pool holds. OpenAI's (and vLLM's) chat default
    when neither ``max_tokens`` nor ``max_completion_tokens`` is sent."""
    rooms = (min(max_len, blocks * limits.block_size) - num_prompt for blocks, max_len in limits.pools)
    return max(1, *rooms)
