"""A step plan as the engine takes it, and what a step gives back: plain data, decoded from the
executor proto by ``server.py`` and run by ``Engine.step``."""

from __future__ import annotations

from dataclasses import dataclass, field

from executor_svc.logprobs import Entry
from executor_svc.sampler import Sampling
from pagedserve.grammar import Spec
from pagedserve.tiers import BlockMove


class PlanError(ValueError):
    """A step plan that cannot be executed as given (bad block ids, positions...)."""


@dataclass(slots=True)
class SeqInput:
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]  # the whole table, or with full_table=False the blocks new since the last step
    sampling: Sampling = field(default_factory=Sampling)
    sample: bool = True
    num_generated: int = 0
    full_table: bool = True
    history: list[int] | None = None  # tokens [0, start_pos), sent with a full table when sampling needs them
    prompt_logprobs: int | None = None  # alternatives per prompt position; None: no prompt logprobs
    prompt_next: int | None = None  # the prompt token after this chunk, if the prompt goes on
    grammar: Spec | None = None  # structured output: (kind, text)
    from_last_sample: bool = False  # the last input is this request's latest sampled token (resolved first)
    lora: LoraRef | None = None  # the LoRA adapter it runs on; None: the base model
    # Speculative decoding: proposed tokens after token_ids (``Engine.step`` appends them to token_ids once
    # the last sample is resolved; ``num_drafts`` then says how many of token_ids' last are drafts).
    drafts: list[int] = field(default_factory=list)
    num_drafts: int = 0


@dataclass(frozen=True, slots=True)
class LoraRef:
    """The adapter a sequence names: its identity, where to load it from, and its name (for errors)."""

    digest: str
    path: str
    name: str = ""


@dataclass(slots=True)
class StepInput:
    step_id: int = 0
    swap_out: list[BlockMove] = field(default_factory=list)
    swap_in: list[BlockMove] = field(default_factory=list)
    copies: list[BlockMove] = field(default_factory=list)
    seqs: list[SeqInput] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)  # requests whose tables can be dropped
    reset_tables: bool = False  # drop every table before this plan


@dataclass(slots=True)
class StepOutput:
    step_id: int
    tokens: list[tuple[str, int]]
    swapped_out: int
    swapped_in: int
    forward_ms: float
    step_ms: float
    swap_in_ms: float = 0.0  # swap-ins and copies before the forward (host time; launch time on CUDA)
    swap_out_ms: float = 0.0  # swap-outs (host time: inline on CPU, launched onto a side stream on CUDA)
    logprobs: dict[str, Entry] = field(default_factory=dict)  # sampled tokens' logprobs, if asked
    # request -> (prompt position of the first entry, one entry per prompt position)
    prompt_logprobs: dict[str, tuple[int, list[Entry]]] = field(default_factory=dict)
    # Rows that ran drafts: the tokens after their first in ``tokens`` (accepted drafts, then the next one).
    more: dict[str, list[int]] = field(default_factory=dict)
    more_logprobs: dict[str, list[Entry]] = field(default_factory=dict)  # theirs, if asked
