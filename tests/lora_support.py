"""What the LoRA test modules share: adapters made with PEFT (random A and B:
``init_lora_weights=False``) and transformers + PEFT's greedy output, the oracle; requests on an
adapter; and what the schedulers' step logs say about where each adapter ran, and beside what."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from pagedserve.v1 import generation_pb2 as pb
from tests.helpers import greedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
rng = random.Random(25)
SHARED = [rng.randrange(3, 49152) for _ in range(32)]  # two blocks every prompt starts with: prefix-cache hits
PROMPTS = [SHARED + [rng.randrange(3, 49152) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
MAX_TOKENS = 40


def make_adapter(base_dir: Path, dst: Path, seed: int, r: int = 8, targets: list[str] = ALL) -> Path:
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(dst)
    return dst


def make_adapters(base_dir: Path, root: Path, specs: dict[str, tuple[int, int, list[str]]]) -> dict[str, Path]:
    """PEFT adapters ``name: (seed, rank, targets)`` on one loaded base model (random A and B)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for name, (seed, r, targets) in specs.items():
        torch.manual_seed(seed)
        peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False))
        peft.save_pretrained(root / name)
        model = peft.unload()
    return {name: root / name for name in specs}


def peft_greedy(base_dir: Path, adapter: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            outs.append(_greedy(model, ids, max_tokens))
    return outs


def _greedy(model: PeftModel, ids: list[int], max_tokens: int) -> list[int]:
    """One prompt's greedy continuation by transformers' ``generate`` (the adapter the model has set)."""
    gen = model.generate(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
    )
    return gen[0, len(ids) :].tolist()


def peft_greedy_each(
    base_dir: Path, paths: dict[str, Path], prompts: list[list[int]], max_tokens: int
) -> dict[str, list[list[int]]]:
    """``peft_greedy`` for several adapters on one loaded base model (``set_adapter`` picks each)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    (first, path), *rest = paths.items()
    model = PeftModel.from_pretrained(base, path, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    model.eval()
    out: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        for name in paths:
            model.set_adapter(name)
            out[name] = []
            for ids in prompts:
                out[name].append(_greedy(model, ids, max_tokens))
    return out


def on(adapter: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    req = greedy(ids, max_tokens)
    req.lora_name = adapter
    return req


def steps_since(paths: list[Path], t: float) -> list[dict]:
    """The step logs' lines (both replicas: each writes its loops' steps) from ``t`` on."""
    rows = []
    for path in paths:
        whole = path.read_text().rpartition("\n")[0] if path.exists() else ""  # a line being written waits
        rows += [json.loads(line) for line in whole.splitlines()]
    return [row for row in rows if row["t"] >= t]


def ran_on(rows: list[dict], adapter: str) -> set[str]:
    """The executors whose steps ran ``adapter``."""
    return {row["executor"] for row in rows if adapter in row["lora_adapters"]}


def mixes_all(rows: list[dict], adapters: int) -> bool:
    """Whether some step ran ``adapters`` adapters and the base model."""
    return any(len(row["lora_adapters"]) == adapters and row["seqs"] > row["lora_seqs"] for row in rows)
