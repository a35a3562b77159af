"""Sampling on plain tensors: greedy, filters, and per-request seeds."""

from __future__ import annotations

import math

import torch

from executor_svc.sampler import PROBE, Sampling, sample


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2, 2.9], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [Sampling(), Sampling()], [0, 0]) == [1, 0]
    top1 = Sampling(temperature=1.0, top_k=1, seed=1)
    tiny_p = Sampling(temperature=1.0, top_p=1e-6, seed=2)
    assert sample(logits, [top1, tiny_p], [0, 0]) == [1, 0]


def test_seed_and_position_decide_the_draw() -> None:
    logits = torch.zeros(1, 1000)
    p = Sampling(temperature=1.0, seed=1234)
    draws = [sample(logits, [p], [n])[0] for n in range(20)]
    assert draws == [sample(logits, [p], [n])[0] for n in range(20)]
    assert len(set(draws)) > 10, "consecutive positions must not repeat the same noise"
    other = [sample(logits, [Sampling(temperature=1.0, seed=99)], [n])[0] for n in range(20)]
    assert other != draws


def test_batch_neighbours_do_not_change_a_seeded_draw() -> None:
    logits = torch.randn(3, 50)
    p = Sampling(temperature=0.7, top_k=10, seed=5)
    alone = sample(logits[1:2], [p], [4])
    batched = sample(logits, [Sampling(), p, Sampling(temperature=1.0)], [0, 4, 0])
    assert batched[1] == alone[0]


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]]))
    counts = torch.zeros(4)
    for n in range(3000):
        counts[sample(logits, [Sampling(temperature=1.0, seed=7)], [n])[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.04)
    top_p = torch.zeros(4)
    for n in range(1000):
        top_p[sample(logits, [Sampling(temperature=1.0, top_p=0.8, seed=7)], [n])[0]] += 1
    assert top_p[2] == 0 and top_p[3] == 0, "tokens outside the 0.8 nucleus are never drawn"


def _full_sort_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: sort the whole vocabulary, cut at k, then at the nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1])[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


# What the sampler promises at the nucleus boundary: a token whose probability mass before it is within
# this distance of top_p may land on either side. The sampler sums that mass in float32 over at most PROBE
# terms (each <= 1, the total <= 1), whose rounding error is bounded by PROBE x float32's epsilon, whatever the
# summation order (the probe's partial sort or a full sort, AVX2 or AVX-512 reductions); everywhere else the
# cut is exact. (A 1e-5 tolerance against a float32 reference failed on AVX2: 1.25e-5 off after 716 terms.)
TOP_P_TOLERANCE = PROBE * torch.finfo(torch.float32).eps


def _assert_same_cut(
    got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> None:
    """``got`` keeps what ``want`` keeps, except tokens sitting on the top_p boundary (within the tolerance)."""
    differ = torch.isinf(got) != torch.isinf(want)
    sorted_logits, order = logits.double().sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1])[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    sorted_probs = sorted_logits.masked_fill(ranks >= k, float("-inf")).softmax(dim=-1)
    before = torch.empty_like(sorted_probs).scatter(-1, order, sorted_probs.cumsum(dim=-1) - sorted_probs)
    near = (before - top_p.double()[:, None]).abs() <= TOP_P_TOLERANCE
    assert not bool((differ & ~near).any()), "a token away from the nucleus boundary was cut differently"
    assert int(differ.sum(dim=-1).max()) <= 2, "more than the boundary token moved"
    both = ~torch.isinf(got) & ~torch.isinf(want)
    assert torch.equal(got[both], want[both])


def test_filter_keeps_exactly_what_a_full_sort_keeps() -> None:
    from executor_svc.sampler import _filter

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=gen) * 3
    cases = [
        ([50, 50, 1, 7, 2999, 3000], [1.0, 0.9, 0.5, 1.0, 0.3, 1.0]),  # every row bounded: topk
        ([0, 50, 5, 0, 40, 3], [1.0, 0.95, 1.0, 0.7, 1.0, 1.0]),  # some unbounded: a full sort
        ([0, 10, 0, 0, 0, 0], [1.0] * 6),  # one row filters, the others keep everything
        ([0] * 6, [1.0] * 6),
    ]  # nothing to filter
    for ks, ps in cases:
        top_k, top_p = torch.tensor(ks), torch.tensor(ps)
        got, want = _filter(logits, top_k, top_p), _full_sort_filter(logits, top_k, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (ks, ps)
        assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_torch_mix_matches_the_python_reference() -> None:
    from executor_svc.sampler import _mix, mix64

    u64 = (1 << 64) - 1
    values = [0, 1, 2, (1 << 63) - 1, -(1 << 63), 12345678901234567, -987654321, 0x9E3779B97F4A7C15 - (1 << 64)]
    assert [v & u64 for v in _mix(torch.tensor(values)).tolist()] == [mix64(v & u64) for v in values]


def test_noise_depends_on_the_key_and_token_only() -> None:
    from executor_svc.sampler import noise, row_key

    keys = torch.tensor([row_key(5, 3), row_key(6, 0)])
    full = noise(keys, torch.arange(49152).expand(2, -1))
    ids = torch.tensor([[0, 7, 49151], [3, 2, 1]])
    assert torch.equal(noise(keys, ids), full.gather(1, ids)), "any subset, in any order, draws the same values"
    assert not torch.equal(full[0], full[1])
    assert abs(full.mean().item() - 1.0) < 0.02 and abs(full.var().item() - 1.0) < 0.05, "Exp(1)"
    assert abs((full < math.log(2)).float().mean().item() - 0.5) < 0.01


def test_a_seeded_draw_does_not_depend_on_its_neighbours_top_k() -> None:
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(3)) * 2
    p = Sampling(temperature=1.0, top_k=5, seed=11)
    for n in range(30):
        alone = sample(logits[:1], [p], [n])[0]
        wide = sample(logits, [p, Sampling(temperature=1.0, top_k=400, seed=1)], [n, n])[0]
        full = sample(logits, [p, Sampling(temperature=1.0, seed=1)], [n, n])[0]
        assert alone == wide == full


def test_top_p_without_top_k_keeps_what_a_full_sort_keeps_when_the_probe_suffices() -> None:
    from executor_svc.sampler import _filter

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 49152, generator=gen) * 4  # peaked: the top PROBE hold most of the mass
    top_k, top_p = torch.tensor([0, 0, 30, 0, 0]), torch.tensor([0.9, 0.5, 0.95, 0.99, 0.7])
    # The reference cuts in float64: only the sampler's own float32 rounding is left to the tolerance.
    want = _full_sort_filter(logits.double(), top_k, top_p.double()).float()
    assert int((~torch.isinf(want)).sum(dim=-1).max()) < PROBE, "the probe path is the one exercised"
    got = _filter(logits, top_k, top_p)
    _assert_same_cut(got, want, logits, top_k, top_p)
    flat = torch.randn(2, 49152, generator=gen) * 0.1  # the nucleus is wider than the probe: a full sort
    got, want = (
        _filter(flat, torch.tensor([0, 0]), torch.tensor([0.9, 0.3])),
        _full_sort_filter(flat, torch.tensor([0, 0]), torch.tensor([0.9, 0.3])),
    )
    assert torch.equal(torch.isinf(got), torch.isinf(want))
