"""Checking a GenerateRequest: pure functions, errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.request import Params
from pagedserve.v1 import generation_pb2 as pb

MAX_REQUEST_ID = 256
MAX_STOP_STRINGS = 16


class InvalidArgument(ValueError):
    """Maps to INVALID_ARGUMENT; the message names the offending field."""


class OverCapacity(RuntimeError):
    """Maps to RESOURCE_EXHAUSTED: the request can never fit in any executor's KV pool."""


class Unavailable(RuntimeError):
    """Maps to UNAVAILABLE: no executor has registered yet, so nothing can be checked or served."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int  # the longest context any executor takes
    vocab_size: int
    block_size: int
    pools: tuple[tuple[int, int], ...]  # per executor: (device blocks, max_model_len)


@dataclass(frozen=True, slots=True)
class Checked:
    """A request whose fields are valid; the prompt is not yet tokenized."""

    request_id: str
    kind: str  # prompt | prompt_token_ids | messages
    params: Params
    stop: list[str]
    priority: int


def check(req: pb.GenerateRequest, limits: Limits) -> Checked:
    given = [name for name, present in (
        ("prompt", bool(req.prompt)),
        ("prompt_token_ids", len(req.prompt_token_ids) > 0),
        ("messages", len(req.messages) > 0),
    ) if present]  # fmt: skip
    if len(given) != 1:
        found = ", ".join(given) or "none"
        raise InvalidArgument(f"exactly one of prompt, prompt_token_ids, messages must be set (got: {found})")
    if len(req.request_id) > MAX_REQUEST_ID:
        raise InvalidArgument(f"request_id: longer than {MAX_REQUEST_ID} characters")
    s = req.sampling
    if s.HasField("max_tokens") and s.max_tokens <= 0:
        raise InvalidArgument("sampling.max_tokens: must be positive")
    if s.HasField("temperature") and not s.temperature >= 0:
        raise InvalidArgument("sampling.temperature: must be >= 0")
    if s.HasField("top_p") and not 0 < s.top_p <= 1:
        raise InvalidArgument("sampling.top_p: must be in (0, 1]")
    if s.HasField("top_k") and s.top_k < 0:
        raise InvalidArgument("sampling.top_k: must be >= 0 (0 disables it)")
    if len(s.stop) > MAX_STOP_STRINGS or any(not x for x in s.stop):
        raise InvalidArgument(f"sampling.stop: at most {MAX_STOP_STRINGS} non-empty strings")
    if any(t >= limits.vocab_size for t in s.stop_token_ids):
        raise InvalidArgument(f"sampling.stop_token_ids: ids must be below the vocabulary size {limits.vocab_size}")
    if any(t >= limits.vocab_size for t in req.prompt_token_ids):
        raise InvalidArgument(f"prompt_token_ids: ids must be below the vocabulary size {limits.vocab_size}")
    for i, m in enumerate(req.messages):
        if not m.role:
            raise InvalidArgument(f"messages[{i}].role: must be set")
    params = Params(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else 16,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )
    return Checked(req.request_id, given[0], params, list(s.stop), req.priority)


def check_length(kind: str, num_prompt: int, params: Params, limits: Limits) -> None:
    """The tokenized prompt must leave room for one token, and the whole request must fit the pool."""
    if num_prompt == 0:
        raise InvalidArgument(f"{kind}: tokenizes to no tokens")
    if num_prompt >= limits.max_model_len:
        raise InvalidArgument(
            f"{kind}: {num_prompt} tokens, but the model's context is {limits.max_model_len} tokens"
        )
    def need(max_len: int) -> int:
        return -(-min(num_prompt + params.max_tokens, max_len) // limits.block_size)

    if not any(need(max_len) <= blocks and num_prompt < max_len for blocks, max_len in limits.pools):
        largest = max(blocks for blocks, _ in limits.pools)
        raise OverCapacity(f"prompt + sampling.max_tokens need {need(limits.max_model_len)} KV blocks; the largest "
                           f"executor pool has {largest}")
