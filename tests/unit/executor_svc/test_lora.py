"""The executor's adapter slots on a toy module: per-token deltas, slot reuse, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor_svc import lora as executor_lora
from executor_svc.lora import Adapters, LoraConfig
from executor_svc.plan import LoraRef, PlanError, SeqInput
from pagedserve import lora


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(6, 5, bias=False)
        self.down_proj = torch.nn.Linear(5, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.q_proj(x))


def write(root: Path, name: str, seed: int, r: int = 2) -> tuple[LoraRef, dict[str, torch.Tensor], float]:
    g = torch.Generator().manual_seed(seed)
    w = {
        "base_model.model.q_proj.lora_A.weight": torch.randn(r, 6, generator=g),
        "base_model.model.q_proj.lora_B.weight": torch.randn(5, r, generator=g),
    }
    d = root / name
    d.mkdir()
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 3 * r, "target_modules": ["q_proj"]}
    (d / lora.CONFIG).write_text(json.dumps(config))
    save_file(w, str(d / lora.WEIGHTS))
    got = lora.read(name, str(d), 16)
    return LoraRef(got.digest, str(d), name), w, 3.0


def seq(rid: str, n: int, ref: LoraRef | None) -> SeqInput:
    return SeqInput(rid, [1] * n, 0, [0], lora=ref)


def test_each_token_gets_its_own_adapters_delta(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Toy()
    adapters = Adapters(model, LoraConfig(max_loras=2, max_lora_rank=4), torch.device("cpu"), torch.float32)
    a, wa, sa = write(tmp_path, "a", 1)
    b, wb, sb = write(tmp_path, "b", 2, r=3)
    x = torch.randn(1, 7, 6)
    adapters.begin([seq("1", 3, a), seq("2", 2, None), seq("3", 2, b)])
    got = model(x)[0]
    adapters.end()
    q = model.q_proj.weight
    want = []
    for t, (w, s) in enumerate([(wa, sa)] * 3 + [(None, 0.0)] * 2 + [(wb, sb)] * 2):
        h = x[0, t] @ q.T
        if w is not None:
            h = (
                h
                + (x[0, t] @ w["base_model.model.q_proj.lora_A.weight"].T)
                @ w["base_model.model.q_proj.lora_B.weight"].T
                * s
            )
        want.append(h @ model.down_proj.weight.T)
    torch.testing.assert_close(got, torch.stack(want))
    torch.testing.assert_close(model(x), (x @ q.T) @ model.down_proj.weight.T, msg="no adapter outside a step")
    assert sorted(adapters.resident()) == sorted([a.digest, b.digest])


def test_slots_are_reused_and_refusals_name_the_problem(tmp_path: Path) -> None:
    model = Toy()
    adapters = Adapters(model, LoraConfig(max_loras=1, max_lora_rank=2), torch.device("cpu"), torch.float32)
    a, _, _ = write(tmp_path, "a", 1)
    b, _, _ = write(tmp_path, "b", 2)
    big, _, _ = write(tmp_path, "big", 3, r=4)
    adapters.begin([seq("1", 1, a)])
    adapters.begin([seq("2", 1, b)])
    assert adapters.resident() == [b.digest], "the one slot went to b"
    with pytest.raises(PlanError, match="uses 2 LoRA adapters; --max-loras is 1"):
        adapters.begin([seq("1", 1, a), seq("2", 1, b)])
    with pytest.raises(PlanError, match="rank 4 exceeds --max-lora-rank 2"):
        adapters.begin([seq("3", 1, big)])
    stale = LoraRef("00" * 32, a.path, "a")
    with pytest.raises(PlanError, match="changed since it was registered"):
        adapters.begin([seq("4", 1, stale)])


def test_small_deltas_run_on_one_thread_and_give_the_threads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Toy()
    adapters = Adapters(model, LoraConfig(max_loras=1, max_lora_rank=2), torch.device("cpu"), torch.float32)
    a, _, _ = write(tmp_path, "a", 1)
    seen: list[int] = []
    real = executor_lora.sgmv_add
    monkeypatch.setattr(executor_lora, "sgmv_add", lambda *args: (seen.append(torch.get_num_threads()), real(*args)))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        adapters.begin([seq("1", 3, a)])
        model(torch.randn(1, 3, 6))
        adapters.end()
        assert seen == [1], "the delta ran on one thread"
        assert torch.get_num_threads() == 2, "and the process's threads are back"
        monkeypatch.setattr(executor_lora, "ONE_THREAD_FLOPS", 0)  # as if the layers were wide
        adapters.begin([seq("1", 3, a)])
        model(torch.randn(1, 3, 6))
        adapters.end()
        assert seen == [1, 2], "a big GEMM keeps the process's threads"
    finally:
        torch.set_num_threads(before)
