"""min_p, penalties, logit_bias, min_tokens and logprobs against obviously-correct references.

The references loop over rows and tokens in plain Python (vLLM's definitions, written
out); the sampler under test is the vectorised one the executor runs.
"""

from __future__ import annotations

import math
import random

import torch

from executor_svc.logprobs import gather
from executor_svc.sampler import Sampling, process, sample

VOCAB = 40


def ref_process(row: list[float], p: Sampling, history: list[int], num_generated: int) -> list[float]:
    """vLLM v1: logit_bias, min_tokens, then repetition, frequency and presence penalties."""
    x = list(row)
    for t, b in p.logit_bias:
        x[t] += b
    if num_generated < p.min_tokens:
        for t in p.min_tokens_ids:
            x[t] = -math.inf
    prompt, outputs = history[: len(history) - num_generated], history[len(history) - num_generated :]
    for t in range(len(x)):
        if t in prompt or t in outputs:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        n = outputs.count(t)
        x[t] -= p.frequency_penalty * n
        if n:
            x[t] -= p.presence_penalty
    return x


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    """vLLM's MinPLogitsProcessor: softmax, drop p < min_p * max p."""
    m = max(row)
    probs = [math.exp(v - m) for v in row]
    z = sum(probs)
    probs = [q / z for q in probs]
    top = max(probs)
    return [-math.inf if q < min_p * top else v for v, q in zip(row, probs)]


def _case(seed: int) -> tuple[torch.Tensor, list[Sampling], list[list[int]], list[int]]:
    rng = random.Random(seed)
    logits = torch.tensor([[rng.gauss(0, 3) for _ in range(VOCAB)] for _ in range(6)])
    params = [
        Sampling(),  # no option: untouched
        Sampling(repetition_penalty=1.7),
        Sampling(presence_penalty=0.9, frequency_penalty=-0.4, temperature=0.7, seed=3),
        Sampling(logit_bias=((2, 5.0), (7, -30.0), (39, 100.0))),
        Sampling(min_tokens=4, min_tokens_ids=(1, 5, 39), repetition_penalty=0.6, frequency_penalty=1.5),
        Sampling(min_tokens=2, min_tokens_ids=(0,), logit_bias=((0, 50.0),), presence_penalty=-2.0),
    ]
    histories = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in params]
    generated = [rng.randrange(0, len(h) + 1) for h in histories]
    generated[5] = 3  # past its min_tokens: the bias applies unmasked
    return logits, params, histories, generated


def test_batch_with_mixed_options_equals_the_per_row_reference() -> None:
    for seed in range(5):
        logits, params, histories, generated = _case(seed)
        got = process(logits, params, generated, histories)
        for i, p in enumerate(params):
            want = torch.tensor(ref_process(logits[i].tolist(), p, histories[i], generated[i]))
            assert torch.allclose(got[i], want, atol=1e-5), (seed, i)
        assert torch.equal(got[0], logits[0])


def test_rows_with_no_option_cost_nothing() -> None:
    logits = torch.randn(4, VOCAB)
    assert process(logits, [Sampling(temperature=0.5)] * 4, [0] * 4, None) is logits


def test_min_tokens_masks_stop_ids_until_enough_outputs() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 10.0  # the stop token would win
    p = Sampling(min_tokens=2, min_tokens_ids=(3,))
    early, late = sample(logits, [p, p], [1, 2])
    assert early != 3 and late == 3


def test_greedy_follows_the_processed_logits() -> None:
    logits, params, histories, generated = _case(11)
    greedy = [Sampling(**{f: getattr(p, f) for f in p.__slots__ if f not in ("temperature", "seed")}) for p in params]
    want = [
        max(range(VOCAB), key=lambda t, i=i: ref_process(logits[i].tolist(), greedy[i], histories[i], generated[i])[t])
        for i in range(len(params))
    ]
    assert sample(logits, greedy, generated, histories) == want


def test_min_p_keeps_what_the_reference_keeps() -> None:
    rng = random.Random(2)
    logits = torch.tensor([[rng.gauss(0, 2) for _ in range(VOCAB)] for _ in range(3)])
    for min_p in (0.0, 0.05, 0.3, 1.0):
        keep = [[v > -math.inf for v in ref_min_p(logits[i].tolist(), min_p)] for i in range(3)]
        allowed = [{t for t in range(VOCAB) if keep[i][t]} for i in range(3)]
        params = [Sampling(temperature=1.0, min_p=min_p, seed=s) for s in range(3)]
        for n in range(60):
            for i, t in enumerate(sample(logits, params, [n] * 3)):
                assert t in allowed[i], (min_p, i, t)
    # min_p = 1 leaves the most likely token only
    top1 = sample(logits, [Sampling(temperature=1.0, min_p=1.0, seed=9)] * 3, [0] * 3)
    assert top1 == logits.argmax(dim=-1).tolist()


def test_seeded_draw_with_every_option_is_reproducible_and_batch_independent() -> None:
    logits, params, histories, generated = _case(4)
    p = Sampling(
        temperature=0.9,
        top_k=20,
        top_p=0.9,
        min_p=0.02,
        seed=77,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias=((4, 2.0),),
        min_tokens=1,
        min_tokens_ids=(0,),
    )
    alone = sample(logits[2:3], [p], [generated[2]], [histories[2]])
    batched = sample(logits, params[:2] + [p] + params[3:], generated, histories)
    assert batched[2] == alone[0] == sample(logits[2:3], [p], [generated[2]], [histories[2]])[0]


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = torch.randn(3, VOCAB) * 4
    lp = torch.log_softmax(logits, dim=-1)
    entries = gather(logits, [5, 0, 39], [0, 3, 20])
    for i, (e, t, k) in enumerate(zip(entries, [5, 0, 39], [0, 3, 20])):
        assert e.token_id == t and abs(e.logprob - lp[i, t].item()) < 1e-6
        assert e.rank == 1 + int((lp[i] > lp[i, t]).sum())
        order = lp[i].argsort(descending=True)[:k].tolist()
        assert list(e.top_ids) == order
        assert torch.allclose(torch.tensor(e.top_logprobs), lp[i, order], atol=1e-6)


def test_a_row_the_processors_leave_without_a_token_samples_its_raw_logits() -> None:
    """A grammar that allows only EOS while min_tokens masks it (found by the fuzz campaign: the
    executor crashed on an empty candidate set): the row falls back to its logits as they came,
    greedy or sampled, filtered or not; a row with no finite logit at all still yields a token."""
    eos = 5
    masked = torch.full((1, 16), float("-inf"))
    masked[0, eos] = 1.0
    for p in (
        Sampling(min_tokens=3, min_tokens_ids=(eos,)),
        Sampling(temperature=0.8, top_k=4, seed=1, min_tokens=3, min_tokens_ids=(eos,)),
        Sampling(temperature=0.8, top_p=0.9, min_tokens=3, min_tokens_ids=(eos,)),
        Sampling(temperature=0.8, min_tokens=3, min_tokens_ids=(eos,)),
    ):
        assert sample(masked.clone(), [p], [0]) == [eos], p
    nothing = torch.full((2, 16), float("-inf"))
    for p in (Sampling(), Sampling(temperature=0.8, top_k=4, seed=1), Sampling(temperature=0.8)):
        (token, _) = sample(nothing.clone(), [p, p], [0, 0])
        assert 0 <= token < 16
