"""Many LoRA adapters on one base model, in one forward pass (``--enable-lora``).

Each targeted linear layer (PEFT's q/k/v/o/gate/up/down) gets a forward hook that
adds the step's LoRA deltas to whatever the base layer computed: the base GEMM is
shared by every token and untouched, so this composes with any implementation of
it. The adapters a step uses sit in ``--max-loras`` device slots (stacked A/B
weights per layer, ``paged_kernels/lora.py``); each token names its sequence's slot, or
``-1`` for the base model. Adapters are read on demand from the directory the plan
names and kept on the CPU (``--max-cpu-loras``, least recently used out); a slot
holding an adapter the step does not use is reassigned least recently used first.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from executor_svc.linear import PackedLinear
from executor_svc.plan import LoraRef, PlanError, SeqInput
from paged_kernels.lora import Segment, segments, sgmv_add, stack_mask, stacked, stacked_add
from pagedserve import lora as adapters

log = logging.getLogger(__name__)
PEFT_PREFIX = "base_model.model."
# A step of at most this many tokens (decodes) whose tokens are not all on one adapter takes every slot at once
# (``stacked_add``: three ops per layer); longer steps (prefills), or one adapter on every token, take SGMV.
STACKED_MAX_TOKENS = 128
# A step whose LoRA GEMMs take at most this many FLOPs on its widest layer runs them on one thread (CPU). A GEMM of
# a few MFLOP gains little from a second thread, and each parallel op ends in a barrier that, on cores shared with
# the scheduler, Redis and the clients, waits for a descheduled thread. In the benchmark's LoRA arm (SmolLM2, 20
# requests over 4 adapters and the base model, 2 cores; decodes 3 MFLOP, prefills up to 43) the executor's
# decode step took 25 ms more than the base model's on the process's two threads and 9 ms on one, and a prefill
# 1.5-1.7x the base model's time per token on two and 1.1-1.3x on one. Bigger GEMMs (a large model's prefill)
# keep the process's threads.
ONE_THREAD_FLOPS = 64e6


@dataclass(frozen=True, slots=True)
class LoraConfig:
    max_loras: int = 1  # device slots: distinct adapters per step
    max_lora_rank: int = 16
    max_cpu_loras: int = 4  # adapters kept on the CPU (at least max_loras)


@dataclass(slots=True)
class Loaded:
    """One adapter as read from its directory: per module name, (A ``[r, in]``, B ``[out, r]``)."""

    digest: str
    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read(ref: LoraRef, max_rank: int, dtype: torch.dtype) -> Loaded:
    """Read and check an adapter: its digest must be the one the plan names (PlanError otherwise)."""
    root = Path(ref.path)
    try:
        config_bytes = (root / adapters.CONFIG).read_bytes()
        blob = (root / adapters.WEIGHTS).read_bytes()
    except OSError as exc:
        raise PlanError(f"LoRA adapter {ref.name!r}: cannot read {ref.path}: {exc.strerror or exc}") from exc
    digest = adapters.digest_of(config_bytes, blob)
    if digest != ref.digest:
        raise PlanError(
            f"LoRA adapter {ref.name!r}: the files at {ref.path} have digest {digest[:12]}, the request names "
            f"{ref.digest[:12]} (changed since it was registered: register it again)"
        )
    try:
        config = json.loads(config_bytes)
        rank = adapters.check_config(config, max_rank)
    except (ValueError, adapters.AdapterError) as exc:
        raise PlanError(f"LoRA adapter {ref.name!r}: {exc}") from exc
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_safetensors(blob)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight").removeprefix(PEFT_PREFIX)
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None or a.shape[0] != rank or b.shape[1] != rank:
            raise PlanError(f"LoRA adapter {ref.name!r}: {module}'s A/B do not have rank {rank}")
        weights[module] = (a.to(dtype), b.to(dtype))
    return Loaded(digest, ref.name, rank, scaling, weights)


@dataclass(slots=True)
class _Target:
    """One hooked linear layer's slots."""

    a: torch.Tensor  # [slots, max_rank, in]
    b: torch.Tensor  # [slots, out, max_rank], a view of [out, slots, max_rank] storage
    present: list[bool]  # per slot: whether its adapter targets this layer
    a_t: torch.Tensor = field(init=False)  # stacked_add's views of a and b (paged_kernels.lora.stacked)
    b_t: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.a_t, self.b_t = stacked(self.a, self.b)


@dataclass(slots=True)
class _Step:
    segs: list[Segment]  # the CPU path's groups
    mask: torch.Tensor | None  # the CPU path's stack_mask, for a decode-sized step not all on one adapter
    token_slots: torch.Tensor  # [T] int32 on the device, for the kernel
    threads: int  # the CPU path's intra-op threads (0: the process's)
    restore: int  # the process's, given back after each delta
    scaling: torch.Tensor  # [slots] float32 on the device
    used: set[int] = field(default_factory=set)


class Adapters:
    """The slots, the CPU cache, and the hooks that add each token's delta."""

    def __init__(self, model: torch.nn.Module, cfg: LoraConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
        n, r = cfg.max_loras, cfg.max_lora_rank
        self.targets: dict[str, _Target] = {}
        for name, module in model.named_modules():
            # A target is torch's Linear, or its oneDNN-packed stand-in (executor_svc/linear.py): the delta is
            # added to whatever computes the base product.
            if name.rsplit(".", 1)[-1] in adapters.TARGETS and isinstance(module, (torch.nn.Linear, PackedLinear)):
                out_f, in_f = module.out_features, module.in_features
                self.targets[name] = _Target(
                    torch.zeros(n, r, in_f, dtype=dtype, device=device),
                    torch.zeros(out_f, n, r, dtype=dtype, device=device).permute(1, 0, 2),
                    [False] * n,
                )
                module.register_forward_hook(self._hook(self.targets[name]))
        self.widest = max((t.a.shape[2] + t.b.shape[1] for t in self.targets.values()), default=0)  # in + out
        self.slots: list[str | None] = [None] * n  # digest per slot
        self.ranks = [0] * n
        self.scalings = [0.0] * n
        self._last_use = [0] * n
        self._clock = 0
        self.cpu: OrderedDict[str, Loaded] = OrderedDict()
        self.step: _Step | None = None
        self.triton = device.type == "cuda"
        log.info("LoRA: %d slots of rank %d on %d layers", n, r, len(self.targets))

    # -- what the membership record and Info report ------------------------------

    def resident(self) -> list[str]:
        return [d for d in self.slots if d is not None]

    def cached(self) -> list[str]:
        return list(self.cpu)

    # -- per step ----------------------------------------------------------------

    def begin(self, seqs: list[SeqInput]) -> None:
        """Put the step's adapters in slots and name each token's slot; no adapter: no hook work."""
        if not any(s.lora is not None for s in seqs):
            self.step = None
            return
        self._clock += 1
        wanted = {s.lora.digest: s.lora for s in seqs if s.lora is not None}
        if len(wanted) > len(self.slots):
            raise PlanError(f"the step uses {len(wanted)} LoRA adapters; --max-loras is {len(self.slots)}")
        slot_of = {d: i for i, d in enumerate(self.slots) if d in wanted}
        for digest, ref in wanted.items():
            if digest not in slot_of:
                slot_of[digest] = self._install(self._cpu_copy(ref), set(slot_of.values()))
            self._last_use[slot_of[digest]] = self._clock
        token_slots: list[int] = []
        for s in seqs:
            token_slots += [slot_of[s.lora.digest] if s.lora is not None else -1] * len(s.token_ids)
        segs = segments(token_slots, self.ranks, self.scalings)
        one_for_all = len(segs) == 1 and segs[0].rows is None
        stacked = not one_for_all and len(token_slots) <= STACKED_MAX_TOKENS and not self.triton
        columns = self.cfg.max_lora_rank * (len(self.slots) if stacked else 1)
        flops = 2 * len(token_slots) * columns * self.widest
        self.step = _Step(
            segs,
            stack_mask(token_slots, self.ranks, self.scalings, self.cfg.max_lora_rank, self.dtype) if stacked else None,
            torch.tensor(token_slots, dtype=torch.int32).to(self.device),
            1 if flops <= ONE_THREAD_FLOPS else 0,
            torch.get_num_threads(),
            torch.tensor(self.scalings, dtype=torch.float32).to(self.device),
        )

    def end(self) -> None:
        self.step = None

    def _cpu_copy(self, ref: LoraRef) -> Loaded:
        got = self.cpu.get(ref.digest)
        if got is None:
            got = read(ref, self.cfg.max_lora_rank, self.dtype)
            unknown = set(got.weights) - set(self.targets)
            if unknown:
                raise PlanError(f"LoRA adapter {ref.name!r}: no such linear layer in the model: {sorted(unknown)[:3]}")
            self.cpu[ref.digest] = got
            while len(self.cpu) > max(self.cfg.max_cpu_loras, 1):
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(ref.digest)
        return got

    def _install(self, adapter: Loaded, taken: set[int]) -> int:
        """The least recently used slot not needed by this step gets ``adapter``'s weights."""
        free = [i for i in range(len(self.slots)) if i not in taken]
        slot = min(free, key=lambda i: (self.slots[i] is not None, self._last_use[i]))
        r = adapter.rank
        for name, target in self.targets.items():
            target.a[slot].zero_()
            target.b[slot].zero_()
            pair = adapter.weights.get(name)
            target.present[slot] = pair is not None
            if pair is not None:
                target.a[slot, :r].copy_(pair[0])
                target.b[slot, :, :r].copy_(pair[1])
        self.slots[slot], self.ranks[slot], self.scalings[slot] = adapter.digest, r, adapter.scaling
        log.info("LoRA adapter %s (%s) in slot %d", adapter.name, adapter.digest[:12], slot)
        return slot

    def _hook(self, target: _Target) -> Any:
        def add_delta(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            step = self.step
            if step is None:
                return out
            x = args[0]
            flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
            if self.triton:
                from paged_kernels.lora_triton import bgmv

                return out + bgmv(flat_x, target.a, target.b, step.scaling, step.token_slots).view_as(out)
            segs = [s for s in step.segs if target.present[s.slot]]
            if not segs:  # no adapter of the step targets this layer
                return out
            if step.threads:
                torch.set_num_threads(step.threads)
            try:  # in place: the base layer's output is this step's own tensor
                if step.mask is not None:
                    stacked_add(flat_out, flat_x, target.a_t, target.b_t, step.mask)
                else:
                    sgmv_add(flat_out, flat_x, target.a, target.b, segs)
            finally:
                if step.threads:
                    torch.set_num_threads(step.restore)
            return out

        return add_delta
