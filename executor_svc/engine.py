"""The executor's domain core: run one step plan on the model and the KV pool.

The engine makes no decisions. The scheduler says which tokens run, which
blocks hold them and which blocks move between tiers; the engine does exactly
that, in one packed forward pass, and returns the sampled tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from executor_svc import attention
from executor_svc.block_tables import BlockTables
from executor_svc.kv_pool import GIB, KVGeometry, KVPool, cpu_tier, device_tier, disk_tier
from executor_svc.pipeline import LastSampled
from executor_svc.sampler import SamplingParams, sample
from kernels import get_backend, make_metadata

TIER_NAMES = ("device", "cpu", "disk")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class PlanError(ValueError):
    """A step plan that cannot be executed as given (bad block ids, positions...)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: Path
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: from gpu_memory_utilization or 512 MiB on CPU
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048  # the largest step, profiled to size the pool on CUDA
    max_model_len: int | None = None
    swap_space: float = 0.0  # GiB of host memory for swapped-out blocks
    swap_dir: Path | None = None
    disk_swap_space: float = 4.0  # GiB on disk, used only with swap_dir
    attention_backend: str = "auto"
    device: str | None = None
    dtype: str = "float32"


@dataclass(frozen=True, slots=True)
class Move:
    src_tier: int
    src: int
    dst_tier: int
    dst: int


@dataclass(slots=True)
class SeqInput:
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]  # the whole table, or with full_table=False the blocks new since the last step
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sample: bool = True
    num_generated: int = 0
    full_table: bool = True
    from_last_sample: bool = False  # the last input is this request's latest sampled token (resolved first)


@dataclass(slots=True)
class StepInput:
    step_id: int = 0
    swap_out: list[Move] = field(default_factory=list)
    swap_in: list[Move] = field(default_factory=list)
    copies: list[Move] = field(default_factory=list)
    seqs: list[SeqInput] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)  # requests whose tables can be dropped
    reset_tables: bool = False  # drop every table before this plan


@dataclass(slots=True)
class StepOutput:
    step_id: int
    tokens: list[tuple[str, int]]
    swapped_out: int
    swapped_in: int
    forward_ms: float
    step_ms: float
    swap_in_ms: float = 0.0  # swap-ins and copies before the forward (host time; launch time on CUDA)
    swap_out_ms: float = 0.0  # swap-outs (host time: inline on CPU, launched onto a side stream on CUDA)


def _eos_ids(model_dir: Path, config: object) -> list[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = getattr(config, "eos_token_id", None)
    for value in eos if isinstance(eos, list) else [eos]:
        if value is not None:
            ids.add(int(value))
    return sorted(ids)


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, cfg.dtype)
        config = AutoConfig.from_pretrained(cfg.model)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).to(self.device).eval()
        self.model.set_attn_implementation(attention.IMPLEMENTATION)
        self.backend = get_backend(cfg.attention_backend, self.device)
        text_config = config.get_text_config()
        heads = text_config.num_attention_heads
        self.geometry = KVGeometry(
            num_layers=text_config.num_hidden_layers,
            block_size=cfg.block_size,
            num_kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
            dtype=dtype,
        )
        self.max_model_len = cfg.max_model_len or text_config.max_position_embeddings
        self.vocab_size = text_config.vocab_size
        self.eos_token_ids = _eos_ids(cfg.model, text_config)
        self.instance_id = uuid.uuid4().hex
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pool = KVPool(
            self.geometry,
            device_tier(self.geometry, self._device_blocks(), self.device),
            cpu_tier(self.geometry, self.geometry.blocks_for(cfg.swap_space * GIB), self.device.type == "cuda")
            if cfg.swap_space > 0
            else None,
            disk_tier(self.geometry, self.geometry.blocks_for(cfg.disk_swap_space * GIB), cfg.swap_dir)
            if cfg.swap_dir is not None and cfg.disk_swap_space > 0
            else None,
        )
        self.tables = BlockTables(self.pool.device.num_blocks)
        self.sampled = LastSampled()  # what a pipelined plan's from_last_sample refers to
        self.model_digest = self._digest()

    def _device_blocks(self) -> int:
        if self.cfg.kv_cache_memory is not None:
            budget = float(self.cfg.kv_cache_memory)
        elif self.device.type == "cuda":
            budget = self._profiled_budget()
        else:
            budget = float(512 << 20)
        blocks = self.geometry.blocks_for(budget)
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget:.0f} bytes holds no {self.geometry.block_bytes}-byte block")
        return blocks

    def _profiled_budget(self) -> float:
        """As vLLM: run the largest step once on a scratch pool, then give the KV pool
        what the utilization fraction leaves after weights, peak activations and
        memory held outside torch (CUDA context, NCCL...)."""
        n = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        scratch = -(-n // self.geometry.block_size)
        self.pool = KVPool(self.geometry, device_tier(self.geometry, scratch, self.device))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        table = torch.arange(scratch, dtype=torch.int32)[None]
        self._forward([SeqInput("profile", [0] * n, 0, [])], table)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        del self.pool
        torch.cuda.empty_cache()
        return total * self.cfg.gpu_memory_utilization - peak - outside_torch

    def tokenizer_files(self) -> dict[str, bytes]:
        return {n: (self.cfg.model / n).read_bytes() for n in TOKENIZER_FILES if (self.cfg.model / n).exists()}

    def _digest(self) -> str:
        """sha256 over config.json and the tokenizer files: what executors of one namespace must share."""
        h = hashlib.sha256()
        for name, data in sorted(self.tokenizer_files().items()):
            h.update(name.encode() + b"\0" + data)
        return h.hexdigest()[:32]

    def renew_instance(self) -> str:
        """Forget every block table and become a new instance (the schedulers evicted the old one)."""
        self.tables.clear()
        self.sampled.clear()
        self.instance_id = uuid.uuid4().hex
        return self.instance_id

    # -- one step -------------------------------------------------------------

    def _move(self, moves: list[Move]) -> None:
        groups: dict[tuple[int, int], list[Move]] = defaultdict(list)
        for m in moves:
            groups[(m.src_tier, m.dst_tier)].append(m)
        for (src_tier, dst_tier), group in groups.items():
            src, dst = self.pool.tier(src_tier), self.pool.tier(dst_tier)
            src_ids = torch.tensor([m.src for m in group])
            dst_ids = torch.tensor([m.dst for m in group])
            if int(src_ids.max()) >= src.num_blocks or int(dst_ids.max()) >= dst.num_blocks:
                raise PlanError(f"block move out of range for tiers {TIER_NAMES[src_tier]}->{TIER_NAMES[dst_tier]}")
            self.backend.copy_blocks(src.k, dst.k, src_ids, dst_ids)
            self.backend.copy_blocks(src.v, dst.v, src_ids, dst_ids)

    def _check(self, seq: SeqInput) -> None:
        end = seq.start_pos + len(seq.token_ids)
        if not seq.token_ids:
            raise PlanError(f"{seq.request_id}: no tokens to run")
        if end > self.max_model_len:
            raise PlanError(f"{seq.request_id}: position {end} exceeds max_model_len {self.max_model_len}")
        if max(seq.token_ids) >= self.vocab_size:
            raise PlanError(f"{seq.request_id}: token id out of vocabulary")
        try:
            self.tables.apply(seq.request_id, seq.block_table, seq.full_table)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
        covered = self.tables.num_blocks_of(seq.request_id)
        if covered * self.geometry.block_size < end:
            raise PlanError(f"{seq.request_id}: block table covers {covered} blocks, needs {end} tokens")

    def _copying(self) -> contextlib.AbstractContextManager[object]:
        """Block copies run on a side stream on CUDA, inline on CPU."""
        return torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else contextlib.nullcontext()

    def step(self, plan: StepInput) -> StepOutput:
        """Swap-ins and copies, then the forward pass; swap-outs overlap the forward.

        Overlap is safe because the scheduler never lets a plan write a block
        that the same plan swaps out. The step returns only once every copy is
        done, so the scheduler may reuse the sources as soon as it has the result.
        """
        t0 = time.perf_counter()
        # First of all: a token the plan refers to by "sampled last step" becomes a token like any other
        # (before a forget or a reset drops it, and before any check or bookkeeping reads token_ids).
        self.sampled.resolve(plan.seqs)
        if plan.reset_tables:
            self.tables.clear()
            self.sampled.clear()
        for rid in plan.forget:
            self.tables.forget(rid)
            self.sampled.forget(rid)
        for seq in plan.seqs:
            self._check(seq)
        ts = time.perf_counter()
        with self._copying():
            self._move(plan.swap_in)
            self._move(plan.copies)
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        tokens: list[tuple[str, int]] = []
        forward_ms = 0.0
        t1 = time.perf_counter()
        logits, sampled = None, []
        if plan.seqs:
            logits, sampled = self._forward(plan.seqs, self.tables.stacked([s.request_id for s in plan.seqs]))
        t2 = time.perf_counter()
        with self._copying():
            self._move(plan.swap_out)
        t3 = time.perf_counter()
        if logits is not None and sampled:
            chosen = sample(logits, [plan.seqs[i].sampling for i in sampled],
                            [plan.seqs[i].num_generated for i in sampled])
            tokens = [(plan.seqs[i].request_id, t) for i, t in zip(sampled, chosen)]
            self.sampled.record(tokens)
        if plan.seqs:
            forward_ms = (time.perf_counter() - t1) * 1e3
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        return StepOutput(
            step_id=plan.step_id,
            tokens=tokens,
            swapped_out=len(plan.swap_out),
            swapped_in=len(plan.swap_in),
            forward_ms=forward_ms,
            step_ms=(time.perf_counter() - t0) * 1e3,
            swap_in_ms=(t1 - ts) * 1e3,
            swap_out_ms=(t3 - t2) * 1e3,
        )

    @torch.inference_mode()
    def _forward(self, seqs: list[SeqInput], tables: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
        """Launch one packed forward pass; returns the logits of the sampled rows.

        ``tables`` holds each sequence's whole block table, one row per sequence.
        """
        dev = self.device
        q_lens = [len(s.token_ids) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long)
        lens = torch.tensor(q_lens)
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        qsl[1:] = lens.cumsum(0)
        starts = torch.tensor([s.start_pos for s in seqs])
        positions = torch.repeat_interleave(starts - qsl[:-1], lens) + torch.arange(len(ids))
        seq_lens = (starts + lens).to(torch.int32)
        meta = make_metadata(tables.to(dev), qsl.to(dev), seq_lens.to(dev), self.geometry.block_size)
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        last = qsl[1:][sampled] - 1 if sampled else torch.tensor([0])
        out = self.model(
            input_ids=ids[None].to(dev),
            position_ids=positions[None].to(dev),
            use_cache=False,
            logits_to_keep=last.to(dev),
            paged=attention.StepContext(meta, self.pool.device, self.backend),
        )
        return (out.logits[0] if sampled else None), sampled
