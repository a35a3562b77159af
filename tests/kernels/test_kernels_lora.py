"""LoRA deltas of a batch mixing adapters: the torch SGMV and stacked paths and the Triton BGMV
kernel (under the interpreter) against the per-token definition (``paged_kernels/lora.py``)."""

import pytest
import torch

from paged_kernels import lora, lora_triton


def _case(gen, tokens=13, slots=3, rank=8, width=40, out=72, dtype=torch.float32):
    x = torch.randn(tokens, width, generator=gen).to(dtype)
    a = torch.randn(slots, rank, width, generator=gen).to(dtype)
    b = torch.randn(slots, out, rank, generator=gen).to(dtype)
    ranks = [rank, rank // 2, 3][:slots]
    for s, r in enumerate(ranks):  # lower ranks are zero-padded in their slot
        a[s, r:] = 0
        b[s, :, r:] = 0
    scaling = torch.tensor([2.0, 0.5, 1.25][:slots])
    token_slots = torch.tensor([(t % (slots + 1)) - 1 for t in range(tokens)], dtype=torch.int32)  # -1: base
    return x, a, b, ranks, scaling, token_slots


def test_sgmv_matches_the_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    x, a, b, ranks, scaling, token_slots = _case(gen)
    base = torch.randn(x.shape[0], b.shape[1], generator=gen)
    out = base.clone()
    segs = lora.segments(token_slots.tolist(), ranks, scaling.tolist())
    lora.sgmv_add(out, x, a, b, segs)
    want = base + lora.bgmv_loop(x, a, b, scaling, token_slots)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    base_rows = token_slots < 0
    assert torch.equal(out[base_rows], base[base_rows]), "a base-model token's output is untouched"


@pytest.mark.parametrize("storage", ["slots-first", "out-first"])
def test_stacked_matches_the_per_token_loop(storage):
    gen = torch.Generator().manual_seed(2)
    x, a, b, ranks, scaling, token_slots = _case(gen)
    if storage == "out-first":  # the executor's: every slot's B side by side is a view
        b = b.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    base = torch.randn(x.shape[0], b.shape[1], generator=gen)
    out = base.clone()
    mask = lora.stack_mask(token_slots.tolist(), ranks, scaling.tolist(), a.shape[1], torch.float32)
    a_t, b_t = lora.stacked(a, b)
    if storage == "out-first":
        assert b_t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(), "a view, no copy"
    lora.stacked_add(out, x, a_t, b_t, mask)
    torch.testing.assert_close(out, base + lora.bgmv_loop(x, a, b, scaling, token_slots), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[token_slots < 0], base[token_slots < 0]), "a base-model token's output is untouched"


def test_sgmv_of_one_adapter_on_every_token_takes_them_all():
    gen = torch.Generator().manual_seed(3)
    x, a, b, ranks, scaling, _ = _case(gen)
    token_slots = torch.full((x.shape[0],), 1, dtype=torch.int32)
    segs = lora.segments(token_slots.tolist(), ranks, scaling.tolist())
    assert len(segs) == 1 and segs[0].rows is None, "no gather, no scatter"
    base = torch.randn(x.shape[0], b.shape[1], generator=gen)
    out = base.clone()
    lora.sgmv_add(out, x, a, b, segs)
    torch.testing.assert_close(out, base + lora.bgmv_loop(x, a, b, scaling, token_slots), rtol=1e-5, atol=1e-5)


def test_sgmv_of_a_step_without_adapters_changes_nothing():
    out = torch.ones(3, 4)
    lora.sgmv_add(out, torch.ones(3, 2), torch.ones(1, 1, 2), torch.ones(1, 4, 1), lora.segments([-1] * 3, [1], [1.0]))
    assert torch.equal(out, torch.ones(3, 4))


@pytest.mark.parametrize(
    ("dtype", "tokens", "width", "out", "rank"),
    [(torch.float32, 13, 40, 72, 8), (torch.float32, 5, 130, 200, 16), (torch.bfloat16, 9, 64, 64, 4)],
)
def test_triton_bgmv_matches_the_per_token_loop(dtype, tokens, width, out, rank):
    gen = torch.Generator().manual_seed(1)
    x, a, b, _, scaling, token_slots = _case(gen, tokens=tokens, rank=rank, width=width, out=out, dtype=dtype)
    got = lora_triton.bgmv(x, a, b, scaling, token_slots)
    assert got.dtype == dtype and got.shape == (tokens, out)
    want = lora.bgmv_loop(x, a, b, scaling, token_slots)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 10)
    assert not got[token_slots < 0].any(), "base-model tokens get no delta"
