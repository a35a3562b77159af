"""The CPU backend's compiled draw for sampled rows that keep the whole vocabulary (``paged_kernels/cpu_race.py``,
``cpu/race.cpp``'s ``race_f32``, through ``sampler.sample``'s ``race``): the distribution, a draw's independence
from its batch, masked tokens, and agreement with a torch reference of the same arithmetic's definition (Gumbel-max
over SplitMix64 noise of key and token id). The library is compiled here, as the executor does at its first start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.sampler import Sampling, _mix, _signed, _srl, row_key, sample
from paged_kernels import cpu_build, cpu_race

GOLDEN = 0x9E3779B97F4A7C15


@pytest.fixture(scope="module")
def race(tmp_path_factory: pytest.TempPathFactory) -> cpu_race.Race:
    try:
        return cpu_race.build(Path(tmp_path_factory.mktemp("kernels")))
    except cpu_build.KernelUnavailable as e:  # pragma: no cover - the suite's machines have g++
        pytest.fail(f"the CPU library must build here: {e}")


def reference(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The same draw in torch, in double: u from the top 24 bits of the hash, then argmax x - log(-log u)."""
    ids = torch.arange(scaled.shape[1], dtype=torch.int64)
    z = _mix(keys[:, None] + (ids + 1) * _signed(GOLDEN))
    u = (_srl(z, 40).double() + 0.5) * 2.0**-24
    return (scaled.double() - torch.log(-torch.log(u))).argmax(dim=-1)


def test_the_draw_follows_the_distribution(race: cpu_race.Race) -> None:
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs).expand(20_000, 4).contiguous()
    keys = torch.tensor([row_key(7, n) for n in range(20_000)], dtype=torch.int64)
    counts = torch.bincount(race(logits, keys), minlength=4).double()
    assert torch.allclose(counts / counts.sum(), probs.double(), atol=0.015)
    assert counts[3] == 0, "a token of probability 0 (-inf) is never drawn"


def test_a_rows_draw_depends_on_its_key_and_logits_only(race: cpu_race.Race) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 49_152, generator=gen)
    keys = torch.tensor([row_key(s, 4) for s in range(8)], dtype=torch.int64)
    whole = race(logits, keys)
    alone = torch.cat([race(logits[i : i + 1], keys[i : i + 1]) for i in range(8)])
    flipped = race(logits.flip(0), keys.flip(0)).flip(0)
    assert torch.equal(whole, alone) and torch.equal(whole, flipped)
    same = race(logits[:1].expand(50, -1).contiguous(), keys[:1].expand(50).contiguous())
    assert set(same.tolist()) == {int(whole[0])}, "one key, one token"
    others = race(logits[:1].expand(50, -1).contiguous(), torch.tensor([row_key(9, n) for n in range(50)]))
    assert len(set(others.tolist())) > 10, "other keys draw other tokens"


def test_it_agrees_with_the_torch_definition(race: cpu_race.Race) -> None:
    """Float logs against double: the two pick the same token except where two tokens' scores are within the
    float log's error (~1e-7 relative), which 512 rows of 49,152 tokens almost never meet."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(512, 49_152, generator=gen) * 2
    keys = torch.tensor([row_key(5, n) for n in range(512)], dtype=torch.int64)
    agree = (race(logits, keys) == reference(logits, keys)).float().mean().item()
    assert agree >= 0.99, agree


def test_sample_uses_it_for_whole_vocabulary_rows_only(race: cpu_race.Race) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 1000, generator=gen)
    whole, topk, greedy = Sampling(temperature=0.8, seed=3), Sampling(temperature=0.8, top_k=5, seed=3), Sampling()
    got = sample(logits, [whole, topk, greedy], [2, 2, 2], race=race)
    assert got[0] == race(logits[:1] / 0.8, torch.tensor([row_key(3, 2)]))[0].item()
    assert got[1] == sample(logits[1:2], [topk], [2])[0], "filtered rows keep their own draw"
    assert got[2] == int(logits[2].argmax())
    assert sample(logits[:1], [whole], [2], race=race) == got[:1], "the batch does not change a seeded draw"
