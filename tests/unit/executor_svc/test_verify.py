"""Speculative decoding's verification on stub logits: every drafted position is sampled as a plain
step at that position would sample it (greedy, seeded, with processors and a grammar), drafts are
accepted while the samples agree, and the sampled distribution is unchanged (a statistical test)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from executor_svc.grammar import Row
from executor_svc.history import Histories
from executor_svc.sampler import Sampling, sample
from executor_svc.verify import accept, expand, sample_rows
from pagedserve.grammar import Compiler
from tests.unit.executor_svc.test_grammar import EOS, Executor, feed, ids


def test_accept_takes_drafts_while_the_samples_agree() -> None:
    assert accept([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted, and the token after them
    assert accept([5, 9, 7], [5, 6]) == [5, 9]  # the first that differs ends the row
    assert accept([4, 6, 7], [5, 6]) == [4]
    assert accept([3], []) == [3]


def test_expand_cuts_each_position_s_history_after_its_drafts() -> None:
    p = Sampling(temperature=1.0, seed=1)
    ps, gens, hists = expand([p, p], [3, 1], [[1, 2, 3, 4, 5], None], [3, 1])
    assert gens == [3, 4, 5, 1] and ps == [p] * 4
    assert hists == [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5], None]


SAMPLINGS = [
    Sampling(),  # greedy
    Sampling(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias=((3, 2.0),)),  # greedy, processed
    Sampling(temperature=0.9, seed=7),  # the whole vocabulary: a torch.Generator per position
    Sampling(temperature=1.1, top_k=5, top_p=0.9, seed=11, presence_penalty=0.7),  # hashed candidates' noise
    Sampling(temperature=1.0, seed=3, min_tokens=6, min_tokens_ids=(0, 1)),  # min_tokens ends mid-drafts
]


@pytest.mark.parametrize("p", SAMPLINGS, ids=["greedy", "greedy-penalized", "seeded", "seeded-topk", "min-tokens"])
def test_each_position_is_sampled_as_a_plain_step_there(p: Sampling) -> None:
    """The rows of a step with drafts against plain steps one position at a time, given the drafts
    as the request's tokens: the same tokens, wherever the drafts are accepted or not."""
    torch.manual_seed(0)
    vocab, prompt, gen = 12, [4, 5, 6], 4
    history = [*prompt, 7, 8, 9, 4]  # the prompt and 4 outputs, the last one run this step
    for drafts in ([5, 6, 7], [1], [9, 9, 9, 9]):
        logits = torch.randn(1 + len(drafts), vocab) * 3
        full = history + drafts  # what the executor's history holds during the step
        (got,) = sample_rows(logits, [p], [gen], [full], [drafts])
        plain = [sample(logits[j : j + 1], [p], [gen + j], [full[: len(history) + j]])[0] for j in range(len(got))]
        assert got == plain
        # And a neighbour in the batch (with its own drafts) changes nothing.
        other = Sampling(temperature=1.0, seed=99)
        both = sample_rows(
            torch.cat([torch.randn(3, vocab), logits]), [other, p], [0, gen], [[1, 2], full], [[3, 3], drafts]
        )
        assert both[1] == got


def test_greedy_accepts_the_longest_prefix_that_matches_the_argmax() -> None:
    logits = torch.full((4, 6), -1.0)
    for j, t in enumerate([2, 3, 5, 1]):  # the argmax at each position
        logits[j, t] = 1.0
    (got,) = sample_rows(logits, [Sampling()], [1], None, [[2, 3, 4]])
    assert accept(got, [2, 3, 4]) == [2, 3, 5]
    (got,) = sample_rows(logits, [Sampling()], [1], None, [[2, 3, 5]])
    assert accept(got, [2, 3, 5]) == [2, 3, 5, 1]


def test_history_drops_rejected_drafts_at_the_next_step() -> None:
    h = Histories()
    h.set("r", [1, 2, 3])
    h.extend("r", [4, 10, 11], 3)  # the last token and two drafts
    h.extend("r", [12], 4)  # only 4 counted: the next step runs from position 4
    assert list(h.get("r") or []) == [1, 2, 3, 4, 12]


def test_the_sampled_distribution_is_unchanged() -> None:
    """Unseeded sampling (the global generator: no token-wise comparison possible) of three tokens
    from a context-dependent stub model over a vocabulary of 3, with drafts that are often wrong,
    against the exact distribution of the sequences: within 0.03 in total variation at 6000 samples
    (the bound's expected deviation is about 0.015; a verifier that accepts a draft whenever it is
    likely enough, say, is off by more than 0.1)."""
    torch.manual_seed(1234)
    vocab = 3

    def logits_of(ctx: list[int]) -> torch.Tensor:
        return torch.tensor([float((sum(ctx) * (i + 2)) % 5) / 2 for i in range(vocab)])

    def prob(seq: tuple[int, ...]) -> float:
        out, ctx = 1.0, [1]
        for t in seq:
            out *= float(torch.softmax(logits_of(ctx), -1)[t])
            ctx.append(t)
        return out

    p = Sampling(temperature=1.0)
    counts: dict[tuple[int, ...], int] = {}
    n = 6000
    for i in range(n):
        out: list[int] = []
        while len(out) < 3:
            ctx = [1, *out]
            drafts = [(i + len(out)) % vocab, 0][: 2 - len(out) + 1]
            logits = torch.stack([logits_of(ctx + drafts[:j]) for j in range(len(drafts) + 1)])
            (got,) = sample_rows(logits, [p], [len(out)], None, [drafts])
            out += accept(got, drafts)
        seq = tuple(out[:3])
        counts[seq] = counts.get(seq, 0) + 1
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - prob(s)) for s in itertools.product(range(vocab), repeat=3))
    assert tv < 0.03, tv
    assert math.isclose(sum(prob(s) for s in itertools.product(range(vocab), repeat=3)), 1.0, rel_tol=1e-5)


def test_grammar_masks_each_draft_row_and_rolls_back(compiler: Compiler, tok: object) -> None:
    """Row j of a structured row with drafts is masked by the matcher after the drafts before it;
    after the step the matcher stands for the tokens the row yielded, not for the drafts."""
    spec = ("regex", "[0-9]{3}")
    one, two, three = (ids(tok, d)[0] for d in "123")
    letter = ids(tok, "x")[0]
    prompt = [1, 5]
    ref = Executor(compiler)
    feed(ref, "r", spec, prompt, [one])
    ref.g.observe("r", spec, [one], 2, False)
    after_one = ref.mask("r", spec, 3, 1)
    ref = Executor(compiler)
    feed(ref, "r", spec, prompt, [one, two])
    ref.g.observe("r", spec, [two], 3, False)
    after_two = ref.mask("r", spec, 4, 2)
    ex = Executor(compiler)
    feed(ex, "r", spec, prompt, [one])
    ex.g.observe("r", spec, [one, two, letter], 2, False)  # the last token, then drafts "2" and "x"
    row = Row(0, "r", spec, 3, 1, (two, letter))
    masks = ex.g.start([row], 3).result()
    assert torch.equal(masks[0], after_one)
    assert torch.equal(masks[1], after_two)  # masked as after "12"
    allowed = lambda m, t: bool((int(m[t // 32]) >> (t % 32)) & 1)  # noqa: E731
    assert allowed(masks[0], two) and not allowed(masks[1], letter)
    yielded = {0: [two, three]}  # "2" accepted, then "3" (not the draft "x")
    ex.g.accept_many([row], yielded)
    assert yielded == {0: [two, three]} and ex.g.stats.broken == 0
    ex.g.observe("r", spec, [three], 4, False)
    final = ex.mask("r", spec, 5, 3)
    assert allowed(final, EOS) and not allowed(final, one), "the matcher stands after 123: only EOS"
