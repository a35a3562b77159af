"""What serving LoRA adapters costs: output tokens/s with adapters against the base model alone.

One deployment with ``--enable-lora`` (SmolLM2, one executor, ``--max-loras`` = the adapters), and
``adapters`` random rank-8 PEFT adapters on every linear layer PEFT targets, made here
(``init_lora_weights=False``) and registered with the load endpoint's gRPC twin. The same
``requests`` greedy requests (``ignore_eos``, ``max_tokens`` each, so every run has the same shape) go
in rounds of three batches:
- **base**: all on the base model;
- **mixed**: spread evenly over the adapters and the base model (``lora_mixed_throughput_ratio``);
- **single**: all on one adapter (``lora_single_adapter_throughput_ratio``).
Each ratio is the median over rounds of a batch's output tokens/s over the base batch's in the
same round (the machine's load drifts between rounds, less within one).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from benchmarks.stack import Stack, StackConfig
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

LORA_KV_BYTES = 256 << 20


@dataclass(slots=True)
class LoraCostConfig:
    adapters: int = 4
    rank: int = 8
    requests: int = 20
    prompt_len: int = 64
    max_tokens: int = 64
    rounds: int = 3
    seed: int = 0


@dataclass(slots=True)
class LoraCostResult:
    mixed_ratio: float  # mixed / base output tokens/s, median over rounds
    single_ratio: float  # one adapter / base
    rounds: list[dict[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def stack_config(logs: Path, cfg: LoraCostConfig) -> StackConfig:
    lora = ("--enable-lora", "--max-loras", str(cfg.adapters), "--max-lora-rank", str(cfg.rank))
    return StackConfig(
        LORA_KV_BYTES, executor_args=lora, scheduler_args=lora, namespace="lora", step_log=logs / "steps.jsonl"
    )


def make_adapters(model_dir: Path, dst: Path, cfg: LoraCostConfig) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    out = []
    for i in range(cfg.adapters):
        torch.manual_seed(cfg.seed + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_cfg = LoraConfig(r=cfg.rank, lora_alpha=2 * cfg.rank, target_modules=targets, init_lora_weights=False)
        get_peft_model(base, peft_cfg).save_pretrained(dst / f"a{i}")
        out.append(dst / f"a{i}")
    return out


def _requests(cfg: LoraCostConfig, names: list[str]) -> list[pb.GenerateRequest]:
    rng = random.Random(cfg.seed)
    reqs = []
    for i in range(cfg.requests):
        ids = [rng.randrange(3, 49152) for _ in range(cfg.prompt_len)]
        s = pb.SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
        reqs.append(pb.GenerateRequest(prompt_token_ids=ids, sampling=s, lora_name=names[i % len(names)]))
    return reqs


async def _one(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> int:
    n = 0
    async for resp in stub.Generate(req, timeout=600):
        n += len(resp.token_ids)
    return n


async def _batch(address: str, reqs: list[pb.GenerateRequest]) -> float:
    """Output tokens/s of ``reqs`` sent at once."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t = time.perf_counter()
        tokens = sum(await asyncio.gather(*(_one(stub, r) for r in reqs)))
        return tokens / (time.perf_counter() - t)


async def _register(address: str, paths: list[Path]) -> list[str]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.GenerationStub(ch)
        names = []
        for i, path in enumerate(paths):
            await stub.LoadLoraAdapter(pb.LoraAdapterRequest(lora_name=f"a{i}", lora_path=str(path)), timeout=60)
            names.append(f"a{i}")
        return names


def run(model_dir: Path, deployment: Stack, work_dir: Path, cfg: LoraCostConfig) -> LoraCostResult:
    """On a live deployment of ``stack_config``: make and register the adapters, then the rounds."""
    names = asyncio.run(_register(deployment.address, make_adapters(model_dir, work_dir, cfg)))
    batches = {
        "base": _requests(cfg, [""]),
        "mixed": _requests(cfg, [*names, ""]),
        "single": _requests(cfg, names[:1]),
    }
    address = deployment.address
    asyncio.run(_batch(address, batches["mixed"][: len(names) + 1]))  # warm-up: every adapter read and placed
    rounds = []
    for _ in range(cfg.rounds):
        got = {name: asyncio.run(_batch(address, reqs)) for name, reqs in batches.items()}
        rounds.append({**{f"{k}_tokens_per_s": v for k, v in got.items()}})
    mixed = statistics.median(r["mixed_tokens_per_s"] / r["base_tokens_per_s"] for r in rounds)
    single = statistics.median(r["single_tokens_per_s"] / r["base_tokens_per_s"] for r in rounds)
    return LoraCostResult(mixed, single, rounds)
