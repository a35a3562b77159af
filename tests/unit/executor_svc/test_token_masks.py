"""allowed_token_ids and bad_words on plain tensors, greedy and sampled, as vLLM masks them."""

from __future__ import annotations

import torch

from executor_svc.sampler import Sampling, sample
from executor_svc.token_masks import banned


def test_a_bad_word_s_last_token_is_banned_only_after_its_prefix() -> None:
    words = [(7,), (3, 4, 5)]
    assert banned(words, []) == {7}
    assert banned(words, [1, 3]) == {7}
    assert banned(words, [1, 3, 4]) == {7, 5}
    assert banned(words, [3, 4, 9]) == {7}
    assert banned([(3, 4)], [3]) == {4} and banned([(3, 4)], [2]) == set()


def test_allowed_token_ids_leave_only_those_under_greedy_and_sampling() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    allowed = (4, 9, 33)
    params = [
        Sampling(allowed_token_ids=allowed),
        Sampling(temperature=1.0, seed=5, allowed_token_ids=allowed),
        Sampling(temperature=1.0, seed=5, top_k=3, allowed_token_ids=allowed),
    ]
    for n in range(30):
        assert set(sample(logits, params, [n] * 3)) <= set(allowed)
    best = max(allowed, key=lambda t: float(logits[0, t]))
    assert sample(logits[:1], params[:1], [0]) == [best]


def test_bad_words_change_the_greedy_pick_only_where_they_match() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 5] = 3.0  # the argmax
    logits[:, 6] = 2.0
    two = Sampling(bad_words=((1, 5),))
    # row 0's outputs end with 1 (its history is prompt [8, 8] + outputs [2, 1]): 5 is banned
    assert sample(logits, [two, two], [2, 2], [[8, 8, 2, 1], [8, 8, 1, 2]]) == [6, 5]
    # the prompt does not count: no outputs yet, though the prompt ends with 1
    assert sample(logits[:1], [two], [0], [[8, 1]]) == [5]
    assert sample(logits[:1], [Sampling(temperature=0.5, seed=1, bad_words=((5,),))], [0])[0] != 5
    assert Sampling(bad_words=((5,),)).needs_history is False and two.needs_history is True
