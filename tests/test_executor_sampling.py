"""The executor's engine on the tiny Llama with the new sampling options: a plan that names a
token id outside the vocabulary anywhere, or lacks a penalized request's history, is refused
(PlanError, INVALID_ARGUMENT on the wire) before anything runs, never a crash; the history is
kept and resent as the step-plan protocol says; logprobs come back for sampled tokens and
prompt chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.engine import Engine, EngineConfig
from executor_svc.plan import PlanError, SeqInput, StepInput
from executor_svc.sampler import Sampling
from tests.helpers import block_bytes


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Engine:
    return Engine(EngineConfig(model=tiny_llama, kv_cache_memory=32 * block_bytes(tiny_llama), device="cpu"))


PEN = Sampling(repetition_penalty=1.5, presence_penalty=0.5)


@pytest.mark.parametrize(
    "seq",
    [
        SeqInput("a", [5, 6], 0, [0], Sampling(logit_bias=((49152, 1.0),))),
        SeqInput("a", [5, 6], 0, [0], Sampling(min_tokens=3, min_tokens_ids=(1 << 31,))),
        SeqInput("a", [5, 6], 0, [0], prompt_logprobs=2, prompt_next=49152),
        SeqInput("a", [5, 6], 16, [0, 1], PEN, history=[7] * 15 + [49152]),
        SeqInput("a", [5, 6], 16, [0, 1], PEN, history=[7] * 3),  # short
        SeqInput("a", [5], 16, [1], PEN, full_table=False),  # no history held, no full table
    ],
    ids=["logit_bias", "min_tokens", "prompt_next", "history-id", "history-short", "history-missing"],
)
def test_plans_naming_bad_ids_or_lacking_history_are_refused(engine: Engine, seq: SeqInput) -> None:
    engine.step(StepInput(reset_tables=True))
    if not seq.full_table:
        engine.step(StepInput(seqs=[SeqInput("a", [5] * 16, 0, [0])]))  # a table, but no history (greedy)
    with pytest.raises(PlanError):
        engine.step(StepInput(seqs=[seq]))


def test_history_is_kept_extended_and_resent(engine: Engine) -> None:
    engine.step(StepInput(reset_tables=True))
    engine.step(StepInput(seqs=[SeqInput("p", [3, 4, 5], 0, [0], PEN)]))
    engine.step(StepInput(seqs=[SeqInput("p", [9], 3, [], PEN, full_table=False)]))
    assert list(engine.histories.get("p") or []) == [3, 4, 5, 9]
    engine.step(StepInput(forget=["p"]))
    assert engine.histories.get("p") is None
    engine.step(StepInput(seqs=[SeqInput("p", [11], 4, [0], PEN, history=[3, 4, 5, 9])]))  # a swap-in
    assert list(engine.histories.get("p") or []) == [3, 4, 5, 9, 11]
    engine.step(StepInput(seqs=[SeqInput("g", [3], 0, [1])]))
    assert "g" not in engine.histories, "requests that need no history keep none"


def test_logprobs_of_sampled_tokens_and_prompt_chunks(engine: Engine) -> None:
    engine.step(StepInput(reset_tables=True))
    prompt = [3, 14, 15, 92, 65, 35]
    first = engine.step(
        StepInput(seqs=[SeqInput("c", prompt[:4], 0, [0], sample=False, prompt_logprobs=2, prompt_next=prompt[4])])
    )
    assert first.tokens == [] and list(first.prompt_logprobs) == ["c"]
    start, entries = first.prompt_logprobs["c"]
    assert start == 1 and [e.token_id for e in entries] == prompt[1:5] and all(len(e.top_ids) == 2 for e in entries)
    last = engine.step(StepInput(seqs=[SeqInput("c", prompt[4:], 4, [0], Sampling(logprobs=3), prompt_logprobs=2)]))
    start, entries = last.prompt_logprobs["c"]
    assert start == 5 and [e.token_id for e in entries] == prompt[5:]
    ((_, token),) = last.tokens
    e = last.logprobs["c"]
    assert e.token_id == token and e.rank == 1 and len(e.top_ids) == 3 and e.top_ids[0] == token
    assert e.logprob == pytest.approx(e.top_logprobs[0]) and e.logprob <= 0
    assert sum(torch.tensor(e.top_logprobs).exp()) <= 1.0
