"""A request as the scheduler sees it: token ids, limits, and where its KV lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from pagedserve.lora import Adapter
from pagedserve.tiers import Tier

if TYPE_CHECKING:
    from scheduler_svc.core.migration import KvSource


class Status(StrEnum):
    WAITING = "waiting"  # not on the device: new, or preempted for recompute
    RUNNING = "running"  # KV on the device
    SWAPPED = "swapped"  # KV in the CPU or disk swap tier
    FINISHED = "finished"


# vLLM's (and OpenAI's completions) default when a request sets no max_tokens; the one place it is written.
DEFAULT_MAX_TOKENS = 16


class Finish(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    DEADLINE = "deadline"  # its queue deadline passed before it started (the API answers DEADLINE_EXCEEDED)


@dataclass(frozen=True, slots=True)
class Params:
    """What decides how a request runs and ends (stop strings live in the frontend)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: tuple[str, str] | None = None  # structured output: (kind, text), pagedserve/grammar.py
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    logprobs: int | None = None  # top alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # top alternatives per prompt token; None: no prompt logprobs
    n: int = 1  # completions of the prompt (parallel sampling): the group this request belongs to has n mates
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text (the frontend's)
    allowed_token_ids: tuple[int, ...] = ()  # only these can be sampled; (): any
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences whose last token is masked after the rest

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def bad_word_prefixes(self) -> bool:
        """Some bad word has tokens before its last: masking it depends on the output so far."""
        return any(len(w) > 1 for w in self.bad_words)


@dataclass(slots=True, eq=False)
class Request:
    """Compared by identity: it is an entity, and field-wise equality would walk
    its token lists whenever a queue or the running list searches for it."""

    request_id: str
    prompt_ids: list[int]
    params: Params = field(default_factory=Params)
    priority: int = 0  # lower is more urgent
    arrival: int = 0  # global submission order, assigned by the store
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V is in the cache
    blocks: list[int] = field(default_factory=list)  # device block table
    swap_blocks: list[tuple[Tier, int]] = field(default_factory=list)  # (tier, block) while swapped
    finish_reason: Finish | None = None
    num_preemptions: int = 0
    deadline_ms: int = 0  # wall clock (ms) by which it must have started; 0: none (core/deadline.py)
    # Output tokens sampled by launched steps whose results are not in yet (the pipelined loop plans
    # one step ahead): counted in num_tokens, absent from output_ids, never stored.
    num_unreported: int = 0
    cache_salt: str | None = None  # mixed into its first block's hash: other salts share none of its blocks
    num_cached: int = 0  # prompt tokens served from the prefix cache when it last started before its first token
    # The chain of its full blocks' hashes (core/prefix.py), extended as tokens are computed;
    # not persisted: a new leader recomputes it from the tokens and the salt.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0  # of its blocks, how many the cache has seen (registered or found a twin)
    # Times its device table lost blocks at its end while it ran (lookahead of rejected drafts:
    # ``BlockManager.trim``). The executor's copy, kept by diffs, still holds them: a plan built after a
    # cut sends the table whole (``loops/plan.py``), else the next lookahead block's diff lands after them.
    table_cuts: int = 0
    # Parallel sampling (SamplingParams.n): the group's id (the request id the client knows; "" for a
    # request of its own) and this completion's index in it. Group mates share one prompt.
    group: str = ""
    index: int = 0
    # A group mate admitted without computing its prompt waits for this mate to have computed it,
    # then shares its blocks (``Scheduler`` forks it); None once forked, and for everyone else.
    source: Request | None = None
    lora: Adapter | None = None  # the LoRA adapter it runs on (--enable-lora); None: the base model
    # KV migration (core/migration.py): a queued request's KV lent by the executor it left; while the
    # destination's pull of it is in flight ``pulling`` is set and the request runs nothing. After a move,
    # ``moved_at_ms`` is when it left its source, until its next token (the stall it saw).
    kv: KvSource | None = None
    pulling: bool = False
    moved_at_ms: int = 0
    # On a prefill executor (core/disagg.py): the decode executor it goes to after its first token ('' for
    # none chosen yet, or none able: then it decodes here). Not stored: a new leader chooses again.
    handoff: str = ""

    @property
    def adapter_digest(self) -> str:
        """Its adapter's identity ('' for the base model): in its prefix-cache root (core/prefix.py)."""
        return self.lora.digest if self.lora is not None else ""

    @property
    def num_known(self) -> int:
        """Prompt and output tokens whose ids are known."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the scheduler plans with: the known ones and those still to be reported."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_unreported

    @property
    def num_pending(self) -> int:
        """Tokens known but not yet in the cache: a prompt (chunk) or the last sampled token."""
        return self.num_tokens - self.num_computed

    def tokens(self, start: int, end: int) -> list[int]:
        """Known token ids at positions [start, end) (an unreported one has no id yet)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def order_key(self) -> tuple[int, int, str]:
        """Priority-policy order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival, self.request_id)
