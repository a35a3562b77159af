"""Checking a GenerateRequest: pure functions, refusals (``refusals``) that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.grammar import MAX_GRAMMAR_BYTES, Spec, choice_ebnf
from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.core.fit import blocks_for, fits_ever
from scheduler_svc.core.prefix import MAX_SALT
from scheduler_svc.core.request import DEFAULT_MAX_TOKENS, Params
from scheduler_svc.frontend import chat_template, tools
from scheduler_svc.frontend.refusals import ContextLength, InvalidArgument, OverCapacity

MAX_REQUEST_ID = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256  # characters; the detokenizer searches each new piece of text for every stop string
MAX_PROMPT_BYTES = 512 << 10  # UTF-8 bytes of prompt text, or of all messages' roles and contents
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_LOGIT_BIAS = 100.0  # |bias| allowed, as OpenAI and vLLM
MAX_CACHE_SALT = MAX_SALT  # characters of cache_salt
MAX_N = 16  # completions per request (sampling.n): bounded, as vLLM had to after a CVE for an unbounded n
MAX_BAD_WORDS = 64  # sampling.bad_words per request
MAX_BAD_WORD_LENGTH = 256  # characters of one bad word
MAX_REQUEST_BYTES = 1 << 20  # a serialized GenerateRequest (checked in server.py, before parsing)


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int  # the longest context any executor takes
    vocab_size: int
    block_size: int
    pools: tuple[tuple[int, int], ...]  # per executor: (device blocks, max_model_len)


@dataclass(frozen=True, slots=True)
class Caps:
    """What one request may ask for, whatever the model could take (the scheduler's
    ``--max-stop-strings``, ``--max-stop-string-length``, ``--max-prompt-bytes``,
    ``--max-logprobs``, ``--max-grammar-bytes``, ``--max-n``)."""

    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_length: int = MAX_STOP_STRING_LENGTH
    max_prompt_bytes: int = MAX_PROMPT_BYTES
    max_logprobs: int = MAX_LOGPROBS
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES  # of a structured-output spec
    max_n: int = MAX_N  # sampling.n


DEFAULT_CAPS = Caps()


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class Checked:
    """A request whose fields are valid; the prompt is not yet tokenized."""

    request_id: str
    kind: str  # prompt | prompt_token_ids | messages
    params: Params
    stop: list[str]
    priority: int
    queue_timeout: float | None = None  # seconds; None: no limit
    grammar_field: str = ""  # the structured-output field that params.grammar came from
    cache_salt: str | None = None  # isolates its prefix-cache blocks (core/prefix.py)
    template: chat_template.Settings = chat_template.Settings()  # how messages are rendered
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: as many as fit; None: all
    bad_words: tuple[str, ...] = ()  # tokenized by the frontend into params.bad_words
    tools: tools.Plan | None = None  # the request's tools (its grammar already in params for required/named)


def _check_caps(req: pb.GenerateRequest, caps: Caps) -> None:
    if req.prompt and (n := _utf8(req.prompt)) > caps.max_prompt_bytes:
        raise InvalidArgument("prompt", f"{n} bytes, over the limit of {caps.max_prompt_bytes} (--max-prompt-bytes)")
    if req.messages and (n := sum(_utf8(m.role) + _utf8(m.content) for m in req.messages)) > caps.max_prompt_bytes:
        raise InvalidArgument(
            "messages",
            f"{n} bytes of roles and contents, over the limit of {caps.max_prompt_bytes} (--max-prompt-bytes)",
        )
    stop = req.sampling.stop
    if len(stop) > caps.max_stop_strings:
        raise InvalidArgument(
            "sampling.stop", f"{len(stop)} strings, at most {caps.max_stop_strings} allowed (--max-stop-strings)"
        )
    for i, x in enumerate(stop):
        if len(x) > caps.max_stop_string_length:
            raise InvalidArgument(
                f"sampling.stop[{i}]",
                f"{len(x)} characters, at most {caps.max_stop_string_length} allowed (--max-stop-string-length)",
            )
    if req.HasField("cache_salt") and len(req.cache_salt) > MAX_CACHE_SALT:
        raise InvalidArgument("cache_salt", f"{len(req.cache_salt)} characters, at most {MAX_CACHE_SALT} allowed")
    if req.HasField("queue_timeout") and not (math.isfinite(req.queue_timeout) and req.queue_timeout > 0):
        raise InvalidArgument("queue_timeout", f"must be a finite number of seconds > 0 (got {req.queue_timeout})")


def structured(s: pb.SamplingParams, caps: Caps = DEFAULT_CAPS) -> tuple[tuple[str, str] | None, str]:
    """The structured-output spec ``(kind, text)`` and the field it came from; (None, "") when unset.
    Whether it compiles is the frontend's check (it needs the tokenizer)."""
    if not s.HasField("structured_output"):
        return None, ""
    so = s.structured_output
    kind = so.WhichOneof("kind")
    name = f"sampling.structured_output.{kind}"
    if kind is None:
        raise InvalidArgument(
            "sampling.structured_output", "set one of json_schema, regex, choice, grammar, json_object"
        )
    if s.ignore_eos:
        raise InvalidArgument(
            "sampling.ignore_eos",
            "cannot be combined with sampling.structured_output (the grammar ends the output with an EOS token)",
        )
    if kind == "json_object":
        if not so.json_object:
            raise InvalidArgument(name, "must be true when set")
        return ("json_object", ""), name
    if kind == "choice":
        choices = list(so.choice.choices)
        if not choices or not all(choices):
            raise InvalidArgument(name, "give at least one choice, each non-empty")
        spec = ("ebnf", choice_ebnf(choices))
    else:
        text = getattr(so, kind)
        if not text:
            raise InvalidArgument(name, "must not be empty")
        spec = ({"grammar": "ebnf"}.get(kind, kind), text)
    if (n := _utf8(spec[1])) > caps.max_grammar_bytes:
        raise InvalidArgument(name, f"{n} bytes, over the limit of {caps.max_grammar_bytes} (--max-grammar-bytes)")
    return spec, name


def _tool_grammar(
    s: pb.SamplingParams, plan: tools.Plan | None, grammar: Spec | None, field: str, caps: Caps
) -> tuple[Spec | None, str]:
    """The grammar of tool_choice required or a named function, in place of a structured output (refused with one)."""
    if plan is None or plan.schema is None:
        return grammar, field
    if grammar is not None:
        raise InvalidArgument("tool_choice", f"{plan.mode} cannot be combined with {field} (both constrain the output)")
    if s.ignore_eos:
        raise InvalidArgument("sampling.ignore_eos", f"cannot be combined with tool_choice {plan.mode}")
    if (n := _utf8(plan.schema)) > caps.max_grammar_bytes:
        raise InvalidArgument(
            "tools", f"{n} bytes as a grammar, over the limit of {caps.max_grammar_bytes} (--max-grammar-bytes)"
        )
    return ("json_schema", plan.schema), "tools"


def check(req: pb.GenerateRequest, limits: Limits, caps: Caps = DEFAULT_CAPS, tool_parser: str = "") -> Checked:
    """``tool_parser``: the scheduler's --tool-call-parser (with --enable-auto-tool-choice; "": none)."""
    given = [name for name, present in (
        ("prompt", bool(req.prompt)),
        ("prompt_token_ids", len(req.prompt_token_ids) > 0),
        ("messages", len(req.messages) > 0),
    ) if present]  # fmt: skip
    if len(given) != 1:
        found = ", ".join(given) or "none"
        raise InvalidArgument(None, f"exactly one of prompt, prompt_token_ids, messages must be set (got: {found})")
    check_request_id(req.request_id)
    _check_caps(req, caps)
    s = req.sampling
    if s.HasField("max_tokens") and s.max_tokens <= 0:
        raise InvalidArgument("sampling.max_tokens", "must be positive")
    if s.HasField("temperature") and not s.temperature >= 0:
        raise InvalidArgument("sampling.temperature", "must be >= 0")
    if s.HasField("top_p") and not 0 < s.top_p <= 1:
        raise InvalidArgument("sampling.top_p", "must be in (0, 1]")
    if s.HasField("top_k") and s.top_k < 0:
        raise InvalidArgument("sampling.top_k", "must be >= 0 (0 disables it)")
    if any(not x for x in s.stop):
        raise InvalidArgument("sampling.stop", "stop strings must be non-empty")
    if any(t >= limits.vocab_size for t in s.stop_token_ids):
        raise InvalidArgument("sampling.stop_token_ids", f"ids must be below the vocabulary size {limits.vocab_size}")
    truncating = req.HasField("truncate_prompt_tokens")
    if len(req.prompt_token_ids) >= limits.max_model_len and not truncating:  # before walking them
        max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        raise ContextLength("prompt_token_ids", limits.max_model_len, len(req.prompt_token_ids), max_tokens)
    if any(t >= limits.vocab_size for t in req.prompt_token_ids):
        raise InvalidArgument("prompt_token_ids", f"ids must be below the vocabulary size {limits.vocab_size}")
    for i, m in enumerate(req.messages):
        if not m.role:
            raise InvalidArgument(f"messages[{i}].role", "must be set")
    _check_sampling(s, limits, caps)
    _check_masks(s, limits)
    template = chat_template.settings(req)
    truncate = req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None
    if truncate is not None and truncate < 1 and truncate != -1:
        raise InvalidArgument("truncate_prompt_tokens", f"must be >= 1, or -1 (got {truncate})")
    grammar, grammar_field = structured(s, caps)
    plan = tools.plan(req, tool_parser)
    grammar, grammar_field = _tool_grammar(s, plan, grammar, grammar_field, caps)
    params = params_of(s, grammar)
    return Checked(
        req.request_id,
        given[0],
        params,
        list(s.stop),
        req.priority,
        req.queue_timeout if req.HasField("queue_timeout") else None,
        grammar_field,
        cache_salt=req.cache_salt or None,
        template=template,
        truncate_prompt_tokens=truncate,
        bad_words=tuple(s.bad_words),
        tools=plan,
    )


# The public SamplingParams' optional fields that Params holds under the same name.
OPTIONAL_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "n",
)


def params_of(s: pb.SamplingParams, grammar: Spec | None) -> Params:
    """The checked public sampling parameters as the scheduler's ``Params``: a field the request
    left unset takes ``Params``' default, the one place each default is written."""
    given = {name: getattr(s, name) for name in OPTIONAL_SAMPLING if s.HasField(name)}
    return Params(
        **given,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in s.logit_bias.items())),
        grammar=grammar,
        include_stop_str_in_output=s.include_stop_str_in_output,
        allowed_token_ids=tuple(sorted(set(s.allowed_token_ids))),
    )


def _check_masks(s: pb.SamplingParams, limits: Limits) -> None:
    """allowed_token_ids and bad_words (the executor's token masks)."""
    if any(t >= limits.vocab_size for t in s.allowed_token_ids):
        raise InvalidArgument(
            "sampling.allowed_token_ids", f"ids must be below the vocabulary size {limits.vocab_size}"
        )
    if len(s.bad_words) > MAX_BAD_WORDS:
        raise InvalidArgument("sampling.bad_words", f"{len(s.bad_words)} words, at most {MAX_BAD_WORDS} allowed")
    for i, w in enumerate(s.bad_words):
        if not w.strip():
            raise InvalidArgument(f"sampling.bad_words[{i}]", "must not be empty or only spaces")
        if len(w) > MAX_BAD_WORD_LENGTH:
            raise InvalidArgument(
                f"sampling.bad_words[{i}]", f"{len(w)} characters, at most {MAX_BAD_WORD_LENGTH} allowed"
            )


def truncated(prompt: list[int], keep: int | None, params: Params, limits: Limits) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last ``keep`` tokens; -1: the last max_model_len - max_tokens."""
    if keep is None:
        return prompt
    room = limits.max_model_len - params.max_tokens
    keep = room if keep == -1 else keep
    if not 1 <= keep <= room:
        raise InvalidArgument(
            "truncate_prompt_tokens",
            f"{keep} tokens to keep, but max_model_len - max_tokens = {limits.max_model_len} - {params.max_tokens}"
            f" = {room}",
        )
    return prompt[-keep:]


def check_request_id(request_id: str) -> None:
    """A client's request id (gRPC request_id, HTTP X-Request-Id or the body's request_id)."""
    if len(request_id) > MAX_REQUEST_ID:
        raise InvalidArgument("request_id", f"longer than {MAX_REQUEST_ID} characters")
    if not all(" " <= c <= "~" for c in request_id):
        # Ids go into Redis keys, queue entries built by Lua (whose string.format cut them at a
        # NUL: found by tests/test_fuzz.py) and gRPC metadata (printable ASCII only).
        raise InvalidArgument("request_id", "printable ASCII only (space to '~')")


def _check_sampling(s: pb.SamplingParams, limits: Limits, caps: Caps) -> None:
    """The fields vLLM added to OpenAI's set, with vLLM's domains."""
    if s.HasField("min_p") and not 0 <= s.min_p <= 1:
        raise InvalidArgument("sampling.min_p", f"must be in [0, 1] (got {s.min_p})")
    for name in ("presence_penalty", "frequency_penalty"):
        if s.HasField(name) and not -2 <= getattr(s, name) <= 2:
            raise InvalidArgument(f"sampling.{name}", f"must be in [-2, 2] (got {getattr(s, name)})")
    if s.HasField("repetition_penalty") and not (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0):
        raise InvalidArgument(
            "sampling.repetition_penalty", f"must be a finite number > 0 (got {s.repetition_penalty})"
        )
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if s.HasField("min_tokens") and s.min_tokens > max_tokens:
        raise InvalidArgument("sampling.min_tokens", f"{s.min_tokens} is more than max_tokens ({max_tokens})")
    for t, b in s.logit_bias.items():
        if t >= limits.vocab_size:
            raise InvalidArgument(
                "sampling.logit_bias", f"token id {t} is not below the vocabulary size {limits.vocab_size}"
            )
        if not (math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
            raise InvalidArgument(
                "sampling.logit_bias",
                f"the bias of token {t} must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (got {b})",
            )
    if s.HasField("n") and not 1 <= s.n <= caps.max_n:
        raise InvalidArgument("sampling.n", f"must be in [1, {caps.max_n}] (got {s.n}; --max-n)")
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name) and getattr(s, name) > caps.max_logprobs:
            raise InvalidArgument(
                f"sampling.{name}", f"{getattr(s, name)} is more than the {caps.max_logprobs} allowed (--max-logprobs)"
            )


def check_length(kind: str, num_prompt: int, params: Params, limits: Limits) -> None:
    """The tokenized prompt must leave room for one token, and the whole request must fit the pool."""
    if num_prompt == 0:
        raise InvalidArgument(kind, "tokenizes to no tokens")
    if num_prompt >= limits.max_model_len:
        raise ContextLength(kind, limits.max_model_len, num_prompt, params.max_tokens)
    if not any(
        fits_ever(num_prompt, params.max_tokens, num_prompt, limits.block_size, blocks, max_len)
        for blocks, max_len in limits.pools
    ):
        need = blocks_for(min(num_prompt + params.max_tokens, limits.max_model_len), limits.block_size)
        raise OverCapacity(need, max(blocks for blocks, _ in limits.pools))
