"""vLLM's ``/tokenize`` and ``/detokenize``: the replica's tokenizer and chat template, as the
completions endpoints apply them, without generating.

``/tokenize`` takes ``prompt`` (a string; ``add_special_tokens`` default true) or ``messages`` (the
chat template; ``add_generation_prompt`` default true, ``continue_final_message`` default false,
``add_special_tokens`` default false; ``tools`` and the history's tool calls rendered as chat
completions render them), and ``return_token_strs``; it answers ``tokens``, ``count``,
``max_model_len`` and ``token_strs``. ``/detokenize`` takes ``tokens`` and answers ``prompt``. Bad
input is a 400 naming the field (``openai_request.bad``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.frontend import openai_request as proto
from scheduler_svc.frontend import tools
from scheduler_svc.frontend.openai_request import bad
from scheduler_svc.frontend.refusals import InvalidArgument


@dataclass(frozen=True, slots=True)
class Tokenize:
    """A checked ``/tokenize`` body: exactly one of ``prompt`` and ``messages``."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, str]]
    add_special_tokens: bool
    add_generation_prompt: bool
    continue_final_message: bool
    return_token_strs: bool
    chat: pb.GenerateRequest | None = None  # messages and tools, as the chat endpoint reads them


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, "must be true or false")
    return v


def model_of(body: dict[str, Any]) -> str | None:
    """The optional ``model`` (vLLM's tokenize requests may leave it out)."""
    v = body.get("model")
    if v is not None and not isinstance(v, str):
        raise bad("model", "must be a string")
    return v


def parse_tokenize(body: dict[str, Any], max_prompt_bytes: int) -> Tokenize:
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad("prompt", "give either prompt or messages")
    chat: list[dict[str, str]] = []
    req = None
    if prompt is not None:
        prompt = proto._text("prompt", prompt)  # a string, no lone surrogate
        size = _utf8(prompt)
    else:
        req = pb.GenerateRequest(tool_choice=pb.ToolChoice(mode=pb.ToolChoice.NONE))  # render tools, read no call
        try:
            proto._messages(req, messages)  # the chat endpoint's checks and content parts
            tools.from_openai(req, {"tools": body.get("tools")})
        except InvalidArgument as exc:
            raise proto.api_error(exc) from None
        chat = [{"role": m.role, "content": m.content} for m in req.messages]
        size = sum(_utf8(m["role"]) + _utf8(m["content"]) for m in chat)
    if size > max_prompt_bytes:
        field = "prompt" if prompt is not None else "messages"
        raise bad(field, f"{size} bytes, over the limit of {max_prompt_bytes} (--max-prompt-bytes)")
    t = Tokenize(
        model_of(body),
        prompt,
        chat,
        _flag(body, "add_special_tokens", prompt is not None),
        _flag(body, "add_generation_prompt", True),
        _flag(body, "continue_final_message", False),
        _flag(body, "return_token_strs", False),
        req,
    )
    if t.messages and t.add_generation_prompt and t.continue_final_message:
        raise bad("continue_final_message", "cannot be true with add_generation_prompt true")
    return t


def tokens_of(tokenizer: Any, t: Tokenize) -> list[int]:
    """The token ids, as the completions endpoints would compute them for the same input."""
    text = t.prompt
    if text is None:
        assert t.chat is not None
        try:
            messages, given = tools.template_messages(
                t.chat, tools.plan(t.chat), tools.renders_tools(getattr(tokenizer, "chat_template", None))
            )
        except InvalidArgument as exc:
            raise proto.api_error(exc) from None
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=given,
                add_generation_prompt=t.add_generation_prompt,
                continue_final_message=t.continue_final_message,
                tokenize=False,
            )
        except Exception as exc:  # jinja errors: the template refused these messages
            raise bad("messages", f"the chat template rejected them: {exc}") from exc
    return list(tokenizer(text, add_special_tokens=t.add_special_tokens).input_ids)


def answer(tokenizer: Any, t: Tokenize, max_model_len: int) -> dict[str, Any]:
    tokens = tokens_of(tokenizer, t)
    strs = tokenizer.convert_ids_to_tokens(tokens) if t.return_token_strs else None
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}


def parse_detokenize(body: dict[str, Any], vocab_size: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad("tokens", "required: a list of token ids")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad(f"tokens[{i}]", f"must be a token id, an integer in [0, {vocab_size})")
    return tokens
