"""Structured output on the executor: one grammar matcher per request, token masks per step.

The matcher is derived state, never stored or sent: the executor rebuilds it from the
request's tokens whenever it lacks one or it is out of step with the plan. It knows
those tokens because it sees every token it runs: a full-table plan sets them to
``history + token_ids`` (``history``: positions [0, start_pos), which the scheduler
sends for structured requests when start_pos > 0), any other plan appends its
``token_ids``. At a sampling step the output so far is ``tokens[prompt_len:]`` with
``prompt_len = start_pos + len(token_ids) - num_generated``.

Per step (``Engine.step``): ``start`` hands the sampled structured rows to a worker
thread, which syncs each matcher and fills its row of the bitmask while the forward
pass runs (xgrammar releases the GIL); ``apply`` masks the logits in one call;
``accept`` feeds each sampled token to its matcher.

A grammar state problem never fails the step: a token the matcher rejects, tokens
the executor does not have, a spec that does not compile here: the row is marked
broken, logged, and from then on may only sample an EOS token, so the request ends
with finish_reason "stop" (its text is cut where the problem arose). Once the
grammar is complete only EOS is allowed; a further step (a pipelined loop may run
one for a finished sequence and discard it) samples EOS again, harmlessly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.grammar import Compiler, GrammarError, Spec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Row:
    """A sampled row of this step that has a grammar."""

    index: int  # row of the step's logits
    request_id: str
    spec: Spec
    end: int  # start_pos + len(token_ids): tokens the request has once this step ran (drafts excluded)
    num_generated: int
    # Speculative decoding: drafts run after its tokens. Their rows follow ``index``, each masked by the
    # matcher advanced through the drafts before it (``_fill``); rolled back in ``accept_many``.
    drafts: tuple[int, ...] = ()


@dataclass(slots=True)
class _Entry:
    spec: Spec
    tokens: list[int] | None = field(default_factory=list)  # positions [0, end of its last step); None: unknown
    matcher: Any = None
    accepted: int = 0  # output tokens the matcher state stands for
    past_end: int = 0  # of those, stop tokens sampled after the grammar completed
    broken: bool = False  # state lost: only EOS from now on


@dataclass(slots=True)
class Stats:
    rows: int = 0  # masks filled
    fill_ms: float = 0.0  # worker time syncing matchers and filling masks
    rebuilds: int = 0
    broken: int = 0


class Grammars:
    """Matchers by request id. ``load`` builds the compiler on first use (it loads the tokenizer);
    ``stop_token_ids``: the executor's EOS ids (the compiler's stop tokens too), which end a request."""

    def __init__(self, load: Callable[[], Compiler], vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._load = load
        self._compiler: Compiler | None = None
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids) or [0]
        self._entries: dict[str, _Entry] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.stats = Stats()

    @property
    def compiler(self) -> Compiler:
        if self._compiler is None:
            self._compiler = self._load()
        return self._compiler

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def clear(self) -> None:
        self._entries.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    # -- tokens ---------------------------------------------------------------

    def observe(
        self,
        request_id: str,
        spec: Spec | None,
        token_ids: Sequence[int],
        start_pos: int,
        full_table: bool,
        history: Sequence[int] = (),
    ) -> None:
        """Record a planned sequence's tokens (before its step runs)."""
        if spec is None:
            self._entries.pop(request_id, None)
            return
        e = self._entries.get(request_id)
        if full_table or e is None or e.spec != spec:
            e = self._entries[request_id] = _Entry(spec)
            e.tokens = [*history, *token_ids] if len(history) == start_pos else None
        elif e.tokens is not None and len(e.tokens) >= start_pos:
            del e.tokens[start_pos:]  # a plan that steps back (a discarded step run again) rewinds them
            e.tokens.extend(token_ids)
        else:
            e.tokens = None  # a gap: the plans skipped tokens we never saw

    # -- one step -------------------------------------------------------------

    def start(self, rows: list[Row], num_rows: int) -> Future[torch.Tensor]:
        """Fill the bitmask (``[num_rows, words]``, all-allowed except ``rows``) in the worker."""
        return self._pool.submit(self._fill, rows, num_rows)

    def _fill(self, rows: list[Row], num_rows: int) -> torch.Tensor:
        t0 = time.perf_counter()
        words = -(-self.vocab_size // 32)
        bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
        for row in rows:
            try:
                e = self._sync(row)
                self._fill_one(e, bitmask, row.index)
                for j, d in enumerate(row.drafts, 1):
                    if e.broken:
                        self._stop_only(bitmask[row.index + j])
                    elif self._consume(e, d):
                        self._fill_one(e, bitmask, row.index + j)
                    else:
                        break  # the mask before excludes this draft: it is rejected, later rows go unused
            except Exception as exc:  # noqa: BLE001 - a grammar state problem ends the row, never the step
                e = self._entries.setdefault(row.request_id, _Entry(row.spec, tokens=None))
                self._break(e, row.request_id, f"no mask ({type(exc).__name__}: {exc})")
                for j in range(1 + len(row.drafts)):
                    self._stop_only(bitmask[row.index + j])
        self.stats.rows += len(rows)
        self.stats.fill_ms += (time.perf_counter() - t0) * 1e3
        return bitmask

    def _fill_one(self, e: _Entry, bitmask: torch.Tensor, index: int) -> None:
        if e.broken or e.matcher.is_terminated():
            self._stop_only(bitmask[index])
        else:
            e.matcher.fill_next_token_bitmask(bitmask, index)

    def _stop_only(self, row: torch.Tensor) -> None:
        row.zero_()
        for t in self.stop_token_ids:
            row[t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)

    def _break(self, e: _Entry, request_id: str, why: str) -> None:
        if not e.broken:
            e.broken = True
            self.stats.broken += 1
            log.error(
                "%s: structured output: %s; ending the output with EOS",
                request_id,
                why,
                extra={"request_id": request_id},
            )

    def _sync(self, row: Row) -> _Entry:
        """The row's entry with its matcher standing for exactly ``num_generated`` output tokens."""
        e = self._entries.get(row.request_id)
        if e is None:  # observe() always runs first; a plan that skipped it still must not crash
            e = self._entries[row.request_id] = _Entry(row.spec, tokens=None)
        if e.broken or (e.matcher is not None and e.accepted == row.num_generated):
            return e
        if e.matcher is not None and e.accepted > row.num_generated and self._rollback(e, row.num_generated):
            return e
        self._rebuild(e, row)
        return e

    def _rollback(self, e: _Entry, n: int) -> bool:
        """Undo the last accepted tokens (a pipelined loop that discarded a step); False: rebuild."""
        k = e.accepted - n
        past = min(k, e.past_end)
        try:
            if k - past:
                e.matcher.rollback(k - past)
        except Exception:  # noqa: BLE001 - rebuild instead
            return False
        e.past_end -= past
        e.accepted = n
        return True

    def _rebuild(self, e: _Entry, row: Row) -> None:
        self.stats.rebuilds += 1
        e.matcher, e.accepted, e.past_end = None, 0, 0
        if e.tokens is None or len(e.tokens) != row.end + len(row.drafts):
            self._break(e, row.request_id, "its tokens are unknown here (no history in the plan)")
            return
        try:
            e.matcher = self.compiler.matcher(row.spec)
        except (GrammarError, OSError) as exc:
            self._break(e, row.request_id, f"the spec does not compile here: {exc}")
            return
        for t in e.tokens[row.end - row.num_generated : row.end]:
            if not self._consume(e, t):
                self._break(e, row.request_id, f"rebuilding, the grammar rejects its token {t}")
                return

    def _consume(self, e: _Entry, token: int) -> bool:
        if e.matcher.is_terminated():
            ok = token in self.stop_token_ids
            e.past_end += ok
        else:
            ok = bool(e.matcher.accept_token(token))
        e.accepted += ok
        return ok

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[Row]) -> None:
        """Mask the grammar rows of ``logits`` ``[num_rows, vocab]`` in place (float32): xgrammar's
        kernel, or the same in torch if that one fails (a missing CUDA toolchain, say)."""
        indices = [r.index + j for r in rows for j in range(1 + len(r.drafts))]
        bitmask = bitmask.to(logits.device, non_blocking=True)
        try:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)
        except Exception as exc:  # noqa: BLE001
            log.warning("xgrammar's apply_token_bitmask_inplace failed (%s); masking in torch", exc)
            apply_torch(logits, bitmask, indices, self.vocab_size)

    def accept(self, rows: list[Row], tokens: list[int]) -> None:
        """Feed each row's sampled token to its matcher; a rejected one becomes EOS (in place)."""
        for row in rows:
            e = self._entries.get(row.request_id)
            if e is None:
                continue
            if e.broken or e.matcher is None or not self._take(e, row.request_id, tokens[row.index]):
                tokens[row.index] = self.stop_token_ids[0]

    def accept_many(self, rows: list[Row], emitted: dict[int, list[int]]) -> None:
        """A step with drafts: each row's matcher goes back to where it stood before its drafts and takes
        the tokens the row yields (``emitted``, by the row's first index); a token it rejects becomes EOS
        and ends the list (in place)."""
        for row in rows:
            e = self._entries.get(row.request_id)
            toks = emitted.get(row.index)
            if e is None or toks is None:
                continue
            if e.broken or e.matcher is None:
                toks[:] = [self.stop_token_ids[0]]
                continue
            if e.accepted > row.num_generated and not self._rollback(e, row.num_generated):
                e.matcher, e.accepted, e.past_end = None, 0, 0  # rebuilt from its tokens at its next step
                continue
            for i, t in enumerate(toks):
                if not self._take(e, row.request_id, t):
                    toks[i:] = [self.stop_token_ids[0]]
                    break

    def _take(self, e: _Entry, request_id: str, token: int) -> bool:
        """Feed ``token`` to the row's matcher; a token it rejects (or an error) breaks the row."""
        try:
            ok = self._consume(e, token)
        except Exception:  # noqa: BLE001
            ok = False
        if not ok:
            self._break(e, request_id, f"the grammar rejects the sampled token {token}")
        return ok


def apply_torch(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int], vocab_size: int) -> None:
    """``apply_token_bitmask_inplace`` in plain torch: bit ``t % 32`` of word ``t // 32`` allows token ``t``."""
    idx = torch.tensor(indices, device=logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[idx].unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    width = min(vocab_size, logits.shape[-1])
    blocked = torch.ones(len(indices), logits.shape[-1], dtype=torch.bool, device=logits.device)
    blocked[:, :width] = ~allowed[:, :width]
    logits[idx] = logits[idx].masked_fill(blocked, float("-inf"))
