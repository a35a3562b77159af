"""``echo`` on ``/v1/completions``: the answer's text, and its logprobs, start with the prompt's.

vLLM's semantics. The text is the prompt (as sent, or its token ids decoded) followed by the
completion. With ``logprobs`` the prompt tokens' entries come first, the first one's logprob
and top alternatives null (nothing predicts it): they are the prompt logprobs the executors
compute, so echo sets ``prompt_logprobs`` to ``logprobs`` unless the body gives it (and the
choice carries them as ``prompt_logprobs`` too, as on vLLM). ``max_tokens: 0`` with echo
answers the prompt alone, lm-eval-harness's loglikelihood request: the request runs with one
token, which the answer drops (``finish_reason`` ``length``, no completion tokens in usage).
Pure functions on plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler_svc.core.logprob import Logprob
from scheduler_svc.frontend.openai_request import bad

# A logprobs entry: a token with its logprob, or a bare token id with none (the prompt's first).
Entry = Logprob | int


@dataclass(frozen=True, slots=True)
class Echo:
    only: bool = False  # max_tokens 0: the prompt alone, no completion
    texts: tuple[str, ...] = ()  # each prompt's text, which its choices start with


def read(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], Echo | None]:
    """The body to parse, and what echo asks (None: off). Echo with ``max_tokens`` 0 runs with
    1; with ``logprobs``, ``prompt_logprobs`` defaults to it."""
    v = body.get("echo")
    if v is None or v is False:
        return body, None
    if v is not True:
        raise bad("echo", "must be true or false")
    if chat:
        raise bad("echo", "not supported on chat completions yet")
    body = dict(body)
    zero = body.get("max_tokens")
    only = isinstance(zero, int | float) and not isinstance(zero, bool) and zero == 0
    if only:
        body["max_tokens"] = 1
    if body.get("logprobs") is not None and body.get("prompt_logprobs") is None:
        body["prompt_logprobs"] = body["logprobs"]
    return body, Echo(only)


def entries(prompt_ids: Sequence[int], prompt_logprobs: Sequence[Logprob] | None) -> list[Entry]:
    """The prompt's logprobs entries: its first token bare, then one per token from the second on."""
    return [prompt_ids[0], *(prompt_logprobs or ())]


def prefixed(
    echo: Echo, text: str, logprobs: Sequence[Entry], prompt_text: str, prompt: Sequence[Entry]
) -> tuple[str, list[Entry]]:
    """A choice's (or its first chunk's) text and logprobs entries with the prompt's in front;
    without the completion's when echo answers the prompt alone."""
    if echo.only:
        return prompt_text, list(prompt)
    return prompt_text + text, [*prompt, *logprobs]
