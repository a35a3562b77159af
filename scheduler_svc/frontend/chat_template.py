"""The chat template's settings of a request (vLLM's chat fields) and the rendering of its messages.

``add_generation_prompt`` (unset: true unless ``continue_final_message``),
``continue_final_message`` (the last message stays open: no end-of-turn after it) and
``chat_template_kwargs`` (extra template variables). ``settings`` is pure (``validate``
calls it); ``render`` runs the model's template through its tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.frontend.refusals import InvalidArgument

# apply_chat_template's own parameters, and what the request's other fields decide: never a template variable.
RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "sanitize_control_tokens",
        "tokenizer_kwargs",
        "chat_template",
        "tools",
        "documents",
    }
)


@dataclass(frozen=True, slots=True)
class Settings:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)


def integral(v: Any) -> Any:
    """A Struct holds every number as a double: whole numbers reach the template as integers."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [integral(x) for x in v]
    if isinstance(v, dict):
        return {k: integral(x) for k, x in v.items()}
    return v


def settings(req: pb.GenerateRequest) -> Settings:
    """The request's template settings; refuses them without messages, both ``add_generation_prompt``
    and ``continue_final_message`` true, and a template variable that is one of ``RESERVED``."""
    kwargs: dict[str, Any] = {}
    if req.HasField("chat_template_kwargs"):
        try:
            kwargs = integral(json_format.MessageToDict(req.chat_template_kwargs))
        except ValueError as exc:  # NaN and infinities have no JSON form
            raise InvalidArgument("chat_template_kwargs", str(exc)) from None
    given = req.HasField("add_generation_prompt") or req.continue_final_message or req.HasField("chat_template_kwargs")
    if given and not req.messages:
        name = next(
            n
            for n, on in (
                ("add_generation_prompt", req.HasField("add_generation_prompt")),
                ("continue_final_message", req.continue_final_message),
                ("chat_template_kwargs", True),
            )
            if on
        )
        raise InvalidArgument(name, "only with messages (the chat template's setting)")
    if req.continue_final_message and req.HasField("add_generation_prompt") and req.add_generation_prompt:
        raise InvalidArgument(
            "continue_final_message", "cannot be combined with add_generation_prompt true (as vLLM refuses it)"
        )
    for key in kwargs:
        if key in RESERVED:
            raise InvalidArgument(f"chat_template_kwargs.{key}", "is not a template variable (set by the request)")
    add = req.add_generation_prompt if req.HasField("add_generation_prompt") else not req.continue_final_message
    return Settings(add, req.continue_final_message, kwargs)


def render(
    tokenizer: Any, messages: list[dict[str, Any]], s: Settings, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The prompt tokens of ``messages`` (and ``tools``, OpenAI's shape) rendered by the model's chat template."""
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=s.add_generation_prompt,
            continue_final_message=s.continue_final_message,
            tokenize=False,
            **s.kwargs,
        )
    except Exception as exc:  # jinja errors: the template refused these messages (or these settings)
        field = "continue_final_message" if s.continue_final_message else "messages"
        raise InvalidArgument(field, f"the chat template rejected them: {exc}") from exc
    return list(tokenizer(text, add_special_tokens=False).input_ids)
