"""The executor's domain core: run one step plan on the model and the KV pool.

The engine makes no decisions. The scheduler says which tokens run, which
blocks hold them and which blocks move between tiers; the engine does exactly
that, in one packed forward pass, and returns the sampled tokens.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from executor_svc import attention, lean, linear, logprobs, model, model_store, verify
from executor_svc.block_tables import BlockTables
from executor_svc.context import check_max_model_len
from executor_svc.grammar import Grammars, Row
from executor_svc.history import Histories
from executor_svc.kv_pool import (
    GIB,
    KVGeometry,
    KVPool,
    cpu_tier,
    device_tier,
    disk_tier,
)
from executor_svc.lora import Adapters, LoraConfig
from executor_svc.plan import PlanError, SeqInput, StepInput, StepOutput
from executor_svc.runner import LastSampled
from executor_svc.sampler import sample
from paged_kernels import get_backend, make_metadata
from pagedserve.grammar import Compiler
from pagedserve.tiers import BlockMove

TIER_NAMES = ("device", "cpu", "disk")


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
    kernel_cache: Path | None = None  # where the CPU kernels are built (None: model_store.cache_dir())
    cpu_linear: str = "auto"  # executor_svc/linear.py: prepacked oneDNN GEMMs on CPU (its own or torch's), or F.linear
    device: str | None = None
    dtype: str = "float32"
    lora: LoraConfig | None = None  # --enable-lora: adapters' slots and caches (executor_svc/lora.py)
    model_impl: str = "auto"  # executor_svc/lean.py where it supports the model (auto), or transformers' forward


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, cfg.dtype)
        config = AutoConfig.from_pretrained(cfg.model)
        hf = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
        self.model = hf.to(self.device).eval()  # type: ignore[arg-type]
        self.model.set_attn_implementation(attention.IMPLEMENTATION)
        kernels = cfg.kernel_cache or model_store.cache_dir()  # where the compiled CPU kernels are built
        self.linear = linear.apply(self.model, cfg.cpu_linear, self.device, kernels)
        self.backend = get_backend(cfg.attention_backend, self.device, kernels)
        self.adapters = Adapters(self.model, cfg.lora, self.device, dtype) if cfg.lora is not None else None
        self.lean = lean.choose(self.model, cfg.model_impl)  # after linear.apply and the adapters: it keeps theirs
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
        self.eos_token_ids = model.eos_ids(cfg.model, getattr(text_config, "eos_token_id", None))
        self.instance_id = uuid.uuid4().hex
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pool = KVPool(
            self.geometry,
            device_tier(self.geometry, self._device_blocks(), self.device),
            cpu_tier(self.geometry, self.geometry.blocks_in(cfg.swap_space * GIB), self.device.type == "cuda")
            if cfg.swap_space > 0
            else None,
            disk_tier(self.geometry, self.geometry.blocks_in(cfg.disk_swap_space * GIB), cfg.swap_dir)
            if cfg.swap_dir is not None and cfg.disk_swap_space > 0
            else None,
        )
        check_max_model_len(cfg.max_model_len, self.pool.device.num_blocks, cfg.block_size)
        self.tables = BlockTables(self.pool.device.num_blocks)
        self.histories = Histories()  # token histories of requests whose sampling needs them
        self.grammars = Grammars(self._grammar_compiler, self.vocab_size, self.eos_token_ids)
        self.sampled = LastSampled()  # what a pipelined plan's from_last_sample refers to
        self.model_digest = model.digest(self.tokenizer_files())

    def _device_blocks(self) -> int:
        if self.cfg.kv_cache_memory is not None:
            budget = float(self.cfg.kv_cache_memory)
        elif self.device.type == "cuda":
            budget = self._profiled_budget()
        else:
            budget = float(512 << 20)
        blocks = self.geometry.blocks_in(budget)
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
        return model.tokenizer_files(self.cfg.model)

    def _grammar_compiler(self) -> Compiler:
        """Built on the first structured request: it loads the tokenizer (~0.5 s)."""
        from transformers import AutoTokenizer

        return Compiler(AutoTokenizer.from_pretrained(self.cfg.model), self.vocab_size, self.eos_token_ids)

    def renew_instance(self) -> str:
        """Forget every block table and become a new instance (the schedulers evicted the old one)."""
        self._forget_all()
        self.instance_id = uuid.uuid4().hex
        return self.instance_id

    def _keepers(self) -> tuple[BlockTables, Histories, Grammars, LastSampled]:
        """Everything the engine keeps per request: dropped together when a plan forgets one."""
        return self.tables, self.histories, self.grammars, self.sampled

    def _forget_all(self) -> None:
        for keeper in self._keepers():
            keeper.clear()

    def _forget(self, request_ids: list[str]) -> None:
        keepers = self._keepers()
        for rid in request_ids:
            for keeper in keepers:
                keeper.forget(rid)

    # -- one step -------------------------------------------------------------

    def _move(self, moves: list[BlockMove]) -> None:
        groups: dict[tuple[int, int], list[BlockMove]] = defaultdict(list)
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
        drafts_ok = seq.sample and seq.prompt_logprobs is None and seq.num_drafts < len(seq.token_ids)
        if seq.num_drafts and not drafts_ok:
            raise PlanError(f"{seq.request_id}: drafts only follow a sampled token, without prompt logprobs")
        if end > self.max_model_len:
            raise PlanError(f"{seq.request_id}: position {end} exceeds max_model_len {self.max_model_len}")
        if max(seq.token_ids) >= self.vocab_size:
            raise PlanError(f"{seq.request_id}: token id out of vocabulary")
        named = seq.sampling.token_ids() + (seq.history or [])
        if seq.prompt_next is not None:
            named.append(seq.prompt_next)
        if named and (max(named) >= self.vocab_size or min(named) < 0):
            raise PlanError(f"{seq.request_id}: sampling names a token id outside the vocabulary")
        try:
            self.tables.apply(seq.request_id, seq.block_table, seq.full_table)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
        covered = self.tables.num_blocks_of(seq.request_id)
        if covered * self.geometry.block_size < end:
            raise PlanError(f"{seq.request_id}: block table covers {covered} blocks, needs {end} tokens")
        if seq.sampling.needs_history:
            if seq.full_table and seq.start_pos > 0 and len(seq.history or ()) != seq.start_pos:
                raise PlanError(
                    f"{seq.request_id}: history has {len(seq.history or ())} tokens, start_pos is {seq.start_pos}"
                )
            if not seq.full_table and seq.request_id not in self.histories:
                raise PlanError(f"{seq.request_id}: no token history held; send the table in full with it")

    def _copying(self) -> contextlib.AbstractContextManager[object]:
        """Block copies run on a side stream on CUDA, inline on CPU."""
        return torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else contextlib.nullcontext()

    def _admit(self, plan: StepInput) -> None:
        """The plan's sequences made ready to run, or a ``PlanError`` before anything runs: last samples resolved,
        drafts appended, forgotten tables dropped, each sequence checked, its adapter loaded, its history kept."""
        # First of all: a token the plan refers to by "sampled last step" becomes a token like any other
        # (before a forget or a reset drops it, and before any check or bookkeeping reads token_ids).
        self.sampled.resolve(plan.seqs)
        for seq in plan.seqs:
            if seq.drafts:  # speculative decoding: the drafts run after the request's tokens (``verify``)
                seq.num_drafts = len(seq.drafts)
                seq.token_ids = seq.token_ids + seq.drafts
        if plan.reset_tables:
            self._forget_all()
        self._forget(plan.forget)
        for seq in plan.seqs:
            self._check(seq)
        if self.adapters is not None:
            self.adapters.begin(plan.seqs)  # loads what the step's adapters need; PlanError before anything runs
        elif any(seq.lora is not None for seq in plan.seqs):
            raise PlanError("a sequence names a LoRA adapter; this executor runs without --enable-lora")
        self._record_history(plan.seqs)

    def step(self, plan: StepInput) -> StepOutput:
        """Swap-ins and copies, then the forward pass; swap-outs overlap the forward.

        Overlap is safe because the scheduler never lets a plan write a block
        that the same plan swaps out. The step returns only once every copy is
        done, so the scheduler may reuse the sources as soon as it has the result.
        """
        t0 = time.perf_counter()
        self._admit(plan)
        masks, grammar_rows = self._start_masks(plan.seqs)
        ts = time.perf_counter()
        with self._copying():
            self._move(plan.swap_in)
            self._move(plan.copies)
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        tokens: list[tuple[str, int]] = []
        more: dict[str, list[int]] = {}
        more_lps: dict[str, list[logprobs.Entry]] = {}
        forward_ms = 0.0
        t1 = time.perf_counter()
        logits, rows = None, _Rows()
        if plan.seqs:
            try:
                logits, rows = self._forward(plan.seqs, self.tables.stacked([s.request_id for s in plan.seqs]))
            finally:
                if self.adapters is not None:
                    self.adapters.end()
        t2 = time.perf_counter()
        with self._copying():
            self._move(plan.swap_out)
        t3 = time.perf_counter()
        lps: dict[str, logprobs.Entry] = {}
        prompt_lps: dict[str, tuple[int, list[logprobs.Entry]]] = {}
        if logits is not None:
            prompt_lps = self._prompt_logprobs(plan.seqs, logits, rows)
            tokens, lps, more, more_lps = self._sample(plan.seqs, logits, rows, masks, grammar_rows)
            self.sampled.record(tokens)
            self.sampled.record([(rid, ts[-1]) for rid, ts in more.items() if ts])
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
            logprobs=lps,
            prompt_logprobs=prompt_lps,
            more=more,
            more_logprobs=more_lps,
        )

    def _record_history(self, seqs: list[SeqInput]) -> None:
        """Grow the token history of every request whose sampling needs it (checked by ``_check``)."""
        for seq in seqs:
            if not seq.sampling.needs_history:
                continue
            if seq.full_table:
                self.histories.set(seq.request_id, (seq.history or [])[: seq.start_pos] + seq.token_ids)
            else:  # from start_pos: a step's rejected drafts (or a discarded step) are dropped first
                self.histories.extend(seq.request_id, seq.token_ids, seq.start_pos)

    def _sample(
        self,
        seqs: list[SeqInput],
        logits: torch.Tensor,
        rows: _Rows,
        masks: Future[torch.Tensor] | None,
        grammar_rows: list[Row],
    ) -> tuple[list[tuple[str, int]], dict[str, logprobs.Entry], dict[str, list[int]], dict[str, list[logprobs.Entry]]]:
        """Structured rows get their token masks first (in place: their logprobs, as vLLM's, are
        those of the masked logits), then every sampled row is drawn. Rows with drafts: every position
        is drawn and the drafts verified (``verify``); the tokens after a row's first come back apart."""
        if not rows.sampled:
            return [], {}, {}, {}
        picked = [seqs[i] for i in rows.sampled]
        last = logits[rows.last] if len(rows.last) != logits.shape[0] else logits
        if grammar_rows and masks is not None:
            last = last.float()
            self.grammars.apply(last, masks.result(), grammar_rows)
        histories = None
        if any(s.sampling.needs_history for s in picked):
            histories = [self.histories.get(s.request_id) if s.sampling.needs_history else None for s in picked]
        more: dict[str, list[int]] = {}
        if any(s.num_drafts for s in picked):
            chosen, first, more = self._verify(picked, last, histories, grammar_rows)
        else:
            chosen = sample(
                last, [s.sampling for s in picked], [s.num_generated for s in picked], histories, self.backend.race
            )
            self.grammars.accept(grammar_rows, chosen)
            first = list(range(len(picked)))
        tokens = [(s.request_id, t) for s, t in zip(picked, chosen)]
        want = [j for j, s in enumerate(picked) if s.sampling.logprobs is not None]
        if not want:
            return tokens, {}, more, {}
        # Each wanted row's tokens: its first, and with drafts the ones after it (at the rows after its first).
        at = [(j, i) for j in want for i in range(1 + len(more.get(picked[j].request_id, ())))]
        targets = [chosen[j] if i == 0 else more[picked[j].request_id][i - 1] for j, i in at]
        entries = logprobs.gather(
            last[[first[j] + i for j, i in at]], targets, [picked[j].sampling.logprobs or 0 for j, _ in at]
        )
        lps: dict[str, logprobs.Entry] = {}
        more_lps: dict[str, list[logprobs.Entry]] = {}
        for (j, i), e in zip(at, entries):
            rid = picked[j].request_id
            if i == 0:
                lps[rid] = e
            else:
                more_lps.setdefault(rid, []).append(e)
        return tokens, lps, more, more_lps

    def _verify(
        self, picked: list[SeqInput], last: torch.Tensor, histories: list | None, grammar_rows: list[Row]
    ) -> tuple[list[int], list[int], dict[str, list[int]]]:
        """A step with drafts: each row's first token, the logits row of each row's first position, and
        the tokens after the first of rows that yield several."""
        drafts = [s.token_ids[len(s.token_ids) - s.num_drafts :] for s in picked]
        sampled = verify.sample_rows(
            last, [s.sampling for s in picked], [s.num_generated for s in picked], histories, drafts, self.backend.race
        )
        first, at = [], 0
        for d in drafts:
            first.append(at)
            at += 1 + len(d)
        emitted = {first[j]: verify.accept(ts, d) for j, (ts, d) in enumerate(zip(sampled, drafts))}
        self.grammars.accept_many(grammar_rows, emitted)
        out = [emitted[f] for f in first]
        more = {s.request_id: ts[1:] for s, ts in zip(picked, out) if s.num_drafts}
        return [ts[0] for ts in out], first, more

    def _prompt_logprobs(
        self, seqs: list[SeqInput], logits: torch.Tensor, rows: _Rows
    ) -> dict[str, tuple[int, list[logprobs.Entry]]]:
        """Row r of a chunk predicts the token at start_pos + r + 1: the chunk's next token,
        or the prompt's next one (``prompt_next``) for its last row."""
        out: dict[str, tuple[int, list[logprobs.Entry]]] = {}
        for i, first in rows.prompt.items():
            seq = seqs[i]
            targets = seq.token_ids[1:] + ([seq.prompt_next] if seq.prompt_next is not None else [])
            if not targets:
                continue
            k = seq.prompt_logprobs or 0
            out[seq.request_id] = (
                seq.start_pos + 1,
                logprobs.gather(logits[first : first + len(targets)], targets, [k] * len(targets)),
            )
        return out

    def _start_masks(self, seqs: list[SeqInput]) -> tuple[Future[torch.Tensor] | None, list[Row]]:
        """Record structured sequences' tokens, then fill their masks in a worker while the forward runs."""
        rows: list[Row] = []
        j = 0
        for seq in seqs:
            if seq.grammar is not None or seq.request_id in self.grammars:
                self.grammars.observe(
                    seq.request_id, seq.grammar, seq.token_ids, seq.start_pos, seq.full_table, seq.history or []
                )
            if seq.sample:
                if seq.grammar is not None:
                    end = seq.start_pos + len(seq.token_ids) - seq.num_drafts
                    drafts = tuple(seq.token_ids[len(seq.token_ids) - seq.num_drafts :])
                    rows.append(Row(j, seq.request_id, seq.grammar, end, seq.num_generated, drafts))
                j += 1 + seq.num_drafts
        return (self.grammars.start(rows, j) if rows else None), rows

    @torch.inference_mode()
    def _forward(self, seqs: list[SeqInput], tables: torch.Tensor) -> tuple[torch.Tensor | None, _Rows]:
        """Launch one packed forward pass; returns the logits of the rows kept (each sampled
        sequence's last token, every token of a chunk with prompt logprobs) and where they are.

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
        rows = _Rows.of(seqs, qsl.tolist())
        keep = torch.tensor(rows.keep or [0]).to(dev)
        ctx = attention.StepContext(meta, self.pool.device, self.backend)
        if self.lean is not None:
            logits = self.lean(ids.to(dev), positions.to(dev), keep, ctx)
        else:
            out = self.model(
                input_ids=ids[None].to(dev),
                position_ids=positions[None].to(dev),
                use_cache=False,
                logits_to_keep=keep,
                paged=ctx,
            )
            logits = out.logits[0]
        return (logits if rows.keep else None), rows


@dataclass(slots=True)
class _Rows:
    """Which packed token positions a step keeps logits for, and where each lands."""

    keep: list[int] = field(default_factory=list)  # packed positions, in order
    sampled: list[int] = field(default_factory=list)  # sequences that sample
    last: list[int] = field(default_factory=list)  # their last token's row in the kept logits
    prompt: dict[int, int] = field(default_factory=dict)  # sequence with prompt logprobs -> its first row

    @classmethod
    def of(cls, seqs: list[SeqInput], qsl: list[int]) -> _Rows:
        r = cls()
        for i, s in enumerate(seqs):
            if s.prompt_logprobs is not None:
                r.prompt[i] = len(r.keep)
                r.keep += range(qsl[i], qsl[i + 1])
                if s.sample:
                    r.sampled.append(i)
                    r.last.append(len(r.keep) - 1)
            elif s.sample:  # its last token's row, and its drafts' (verify.py)
                r.sampled.append(i)
                for p in range(qsl[i + 1] - 1 - s.num_drafts, qsl[i + 1]):
                    r.last.append(len(r.keep))
                    r.keep.append(p)
        return r
