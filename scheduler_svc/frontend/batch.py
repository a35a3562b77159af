"""Batched prompts on ``/v1/completions``: ``prompt`` a list of strings or of token-id lists.

Each prompt is its own request, ``<id>-<i>`` (vLLM's naming), checked as a request alone;
``Frontend.generate`` takes them as one batch (submitted in order, admitted as one group of
completions is) and streams them merged. The answer is one completion object whose choice
``index`` is prompt index × n + completion index (vLLM's), with usage summed over prompts.
Pure functions, and the one generator that renumbers the merged chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from scheduler_svc.frontend.openai_request import ApiError, bad
from scheduler_svc.frontend.streams import Chunk

MAX_PROMPTS = 256  # per request: each is a request of its own (times n)


def prompts(v: Any) -> list[Any] | None:
    """The prompts of a batch, or None when ``prompt`` is one prompt (a string, token ids, or
    a list of exactly one of either: ``openai_request.parse`` reads those)."""
    if not (isinstance(v, list) and len(v) > 1 and all(isinstance(x, str | list) for x in v)):
        return None
    if len(v) > MAX_PROMPTS:
        raise bad("prompt", f"{len(v)} prompts, over the limit of {MAX_PROMPTS} per request")
    return v


def request_id(base: str, i: int) -> str:
    return f"{base}-{i}"


def renamed(err: ApiError, i: int) -> ApiError:
    """A refusal about prompt ``i`` of a batch, naming it: ``prompt`` becomes ``prompt[i]``."""
    param = err.param or ""
    if param != "prompt" and not param.startswith("prompt["):
        return err
    new = f"prompt[{i}]" + param[len("prompt") :]
    message = new + err.message[len(param) :] if err.message.startswith(param) else err.message
    return ApiError(err.status, message, err.type, new, err.code, err.headers, err.extra)


async def numbered(chunks: AsyncIterator[Chunk], order: dict[str, int], n: int) -> AsyncIterator[Chunk]:
    """The batch's chunks with ``index`` the choice's: its prompt's place (``order``, by request
    id) × n + its completion's index. Closing it closes ``chunks`` (which aborts what runs)."""
    try:
        async for chunk in chunks:
            chunk.index += order[chunk.request_id] * n
            yield chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
