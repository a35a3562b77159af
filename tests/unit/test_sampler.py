"""Sampling on plain tensors: greedy, filters, and per-request seeds."""

from __future__ import annotations

import torch

from executor_svc.sampler import SamplingParams, sample


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2, 2.9], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [0, 0]) == [1, 0]
    top1 = SamplingParams(temperature=1.0, top_k=1, seed=1)
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6, seed=2)
    assert sample(logits, [top1, tiny_p], [0, 0]) == [1, 0]


def test_seed_and_position_decide_the_draw() -> None:
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=1234)
    draws = [sample(logits, [p], [n])[0] for n in range(20)]
    assert draws == [sample(logits, [p], [n])[0] for n in range(20)]
    assert len(set(draws)) > 10, "consecutive positions must not repeat the same noise"
    other = [sample(logits, [SamplingParams(temperature=1.0, seed=99)], [n])[0] for n in range(20)]
    assert other != draws


def test_batch_neighbours_do_not_change_a_seeded_draw() -> None:
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=0.7, top_k=10, seed=5)
    alone = sample(logits[1:2], [p], [4])
    batched = sample(logits, [SamplingParams(), p, SamplingParams(temperature=1.0)], [0, 4, 0])
    assert batched[1] == alone[0]


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]]))
    counts = torch.zeros(4)
    for n in range(3000):
        counts[sample(logits, [SamplingParams(temperature=1.0, seed=7)], [n])[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.04)
    top_p = torch.zeros(4)
    for n in range(1000):
        top_p[sample(logits, [SamplingParams(temperature=1.0, top_p=0.8, seed=7)], [n])[0]] += 1
    assert top_p[2] == 0 and top_p[3] == 0, "tokens outside the 0.8 nucleus are never drawn"
