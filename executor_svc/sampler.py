"""Token sampling, vectorised across the batch, reproducible per request.

vLLM v1's order: on the raw logits the ``allowed_token_ids`` and ``bad_words`` masks
(``token_masks``), ``logit_bias``, the ``min_tokens`` mask, then the penalties
(repetition over prompt and output tokens, frequency and presence over output tokens);
greedy rows take the argmax of that; sampled rows then divide by their temperature,
drop what ``min_p``, ``top_k`` and ``top_p`` exclude, and draw. Each processor touches
only the rows that asked for it, gathered with index tensors built once per step: a
batch that asks for none costs what it cost before.

A sampled row draws by an exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)``,
its noise determined by ``(seed, num_generated)``: the token at a given output
position does not depend on what else ran in the batch or on whether the request
was preempted and recomputed in between (the penalties' inputs, the request's
tokens, do not depend on it either). A row that top-k or top-p filters draws its
noise only for its candidates, as a counter-based hash of ``(seed, num_generated,
token id)`` (SplitMix64) computed for all such rows at once; a row that keeps the
whole vocabulary is drawn by the CPU backend's compiled race (``race``: the same hash's
noise for every token, in one vectorised pass; vLLM's CPU sampler is a fused op too), or
without it from a ``torch.Generator`` seeded with ``(seed, num_generated)``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor_svc import token_masks
from paged_kernels.cpu_race import Draw

PROBE = 1024  # tokens a top-p-only cut is first looked for in
PROBE_MARGIN = 1e-4
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive positions apart
_MASK63 = (1 << 63) - 1
_U64 = (1 << 64) - 1
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's finalizer


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def mix64(z: int) -> int:
    """SplitMix64's finalizer on a Python int (the reference for ``_mix``)."""
    z = ((z ^ (z >> 30)) * _M1) & _U64
    z = ((z ^ (z >> 27)) * _M2) & _U64
    return z ^ (z >> 31)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (multiplication wraps mod 2^64)."""
    z = (z ^ _srl(z, 30)) * _signed(_M1)
    z = (z ^ _srl(z, 27)) * _signed(_M2)
    return z ^ _srl(z, 31)


def noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise for token ``ids`` ``[R, W]`` of rows with ``keys`` ``[R]`` (int64): a
    function of (key, id) only, so any subset or order of candidates draws the same values."""
    z = _mix(keys[:, None] + (ids + 1) * _signed(_MIX))
    u = (_srl(z, 11).double() + 0.5) * 2.0**-53  # 53 bits, in (0, 1)
    return (-torch.log(u)).float()


def row_key(seed: int, num_generated: int) -> int:
    """A seeded row's noise key at output position ``num_generated``."""
    return _signed(mix64((seed * _MIX + num_generated) & _U64))


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()  # masked while fewer than min_tokens outputs exist (stop ids, EOS)
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # alternatives returned with the sampled token's logprob; None: no logprobs
    allowed_token_ids: tuple[int, ...] = ()  # only these can be sampled; (): any
    bad_words: tuple[tuple[int, ...], ...] = ()  # vLLM's bad words as token sequences (token_masks.py)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Whether the executor must keep this request's tokens (``executor_svc.history``)."""
        return self.penalized or any(len(w) > 1 for w in self.bad_words)

    @property
    def masked(self) -> bool:
        """Whether ``token_masks`` has work on this row."""
        return bool(self.allowed_token_ids or self.bad_words)

    def token_ids(self) -> list[int]:
        """Every token id these parameters name (checked against the vocabulary)."""
        named = [t for t, _ in self.logit_bias] + list(self.min_tokens_ids) + list(self.allowed_token_ids)
        return named + [t for w in self.bad_words for t in w]


def _candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's top-k and top-p candidates: ``(logits [R, W], ids [R, W])``, most likely
    first, -inf past a row's own cut; ``ids`` None when no row filters (the whole vocabulary,
    in order).

    Only the candidates that can survive are sorted: with every row's top-k bounded,
    ``topk`` of the largest k instead of a sort of the whole vocabulary (on CPU a sort of
    49,152 logits per row cost as much as the forward pass at batch 64). The result is the
    same, since top-p applies to what top-k kept. Top-p without top-k first tries the top
    ``PROBE`` tokens: when they hold more than top_p of the row's mass (a model's
    distribution usually does), nothing past them can be kept, and the sort of the whole
    vocabulary is skipped.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    if bool((k == vocab).all()) and bool((top_p >= 1.0).all()):
        return logits, None  # no row filters anything
    width = int(k.max())
    total = None  # log of each row's mass the top-p cut is relative to; None: the kept top-k's
    if width > PROBE:
        sorted_logits, order = logits.topk(PROBE, dim=-1)
        full = torch.logsumexp(logits, dim=-1)
        held = torch.exp(torch.logsumexp(sorted_logits, dim=-1) - full)
        # A margin far above rounding: past the probe every token's mass-before is >= top_p.
        if bool(((k <= PROBE) | ((k == vocab) & (held >= top_p + PROBE_MARGIN))).all()):
            width, total = PROBE, torch.where(k == vocab, full, float("nan"))
    if total is None:
        if width < vocab:
            sorted_logits, order = logits.topk(width, dim=-1)
        else:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(width, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    if total is not None:  # rows with no top-k: their mass over the whole vocabulary
        unbounded = (k == vocab)[:, None]
        probs = torch.where(unbounded, torch.exp(sorted_logits - total[:, None]), probs)
    # Keep a token if the mass strictly before it is below top_p (the first is always kept).
    before = probs.cumsum(dim=-1) - probs
    # top_p = 1 keeps everything, even where rounding makes the cumulative mass reach 1.
    drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return sorted_logits.masked_fill(drop, float("-inf")), order


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf."""
    kept, order = _candidates(logits, top_k, top_p)
    if order is None:
        return logits
    return torch.full_like(logits, float("-inf")).scatter(-1, order, kept)


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p: drop tokens whose probability is below ``min_p`` x the top one's.
    p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p), so no softmax is needed."""
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < floor, float("-inf"))


def _bias(logits: torch.Tensor, params: Sequence[Sampling], num_generated: Sequence[int]) -> None:
    """logit_bias and the min_tokens mask, in place: one index_put per kind for the whole batch."""
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            rows.append(i)
            cols.append(t)
            vals.append(b)
    if rows:
        dev = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
            torch.tensor(vals, device=dev, dtype=logits.dtype),
            accumulate=True,
        )
    rows, cols = [], []
    for i, p in enumerate(params):
        if num_generated[i] < p.min_tokens:
            masked = set(p.min_tokens_ids)
            rows += [i] * len(masked)
            cols += sorted(masked)
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")


def _penalize(
    logits: torch.Tensor,
    params: Sequence[Sampling],
    num_generated: Sequence[int],
    histories: Sequence[Sequence[int] | None],
) -> None:
    """vLLM's penalties, in place, on the rows that set one.

    Token counts come from one scatter of the rows' histories (prompt + outputs so far)
    into an ``[R, vocab]`` tensor: outputs are each history's last ``num_generated`` tokens.
    """
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[-1]
    hist = [h if (h := histories[i]) is not None else array("l") for i in rows]
    lens = torch.tensor([len(h) for h in hist])
    flat = torch.tensor([t for h in hist for t in h], dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(len(rows)), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(len(flat)) - torch.repeat_interleave(starts, lens)
    prompt_len = lens - torch.tensor([min(num_generated[i], len(h)) for i, h in zip(rows, hist)])
    is_out = pos >= torch.repeat_interleave(prompt_len, lens)
    flat, row_of, is_out = flat.to(dev), row_of.to(dev), is_out.to(dev)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
    seen[row_of, flat] = True
    counts = torch.zeros(len(rows), vocab, dtype=logits.dtype, device=dev)
    counts.index_put_(
        (row_of[is_out], flat[is_out]),
        torch.ones(1, dtype=logits.dtype, device=dev).expand(int(is_out.sum())),
        accumulate=True,
    )
    sel = torch.tensor(rows, device=dev)
    sub = logits[sel]
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=dev, dtype=logits.dtype)[:, None]
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=dev, dtype=logits.dtype)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=dev, dtype=logits.dtype)[:, None]
    pen = torch.where(seen, rep, torch.ones_like(rep))
    sub = torch.where(sub > 0, sub / pen, sub * pen)
    sub = sub - freq * counts - pres * (counts > 0).to(logits.dtype)
    logits[sel] = sub


def process(
    logits: torch.Tensor,
    params: Sequence[Sampling],
    num_generated: Sequence[int],
    histories: Sequence[Sequence[int] | None] | None = None,
) -> torch.Tensor:
    """The raw-logit processors (token masks, logit_bias, min_tokens, penalties); returns
    ``logits`` itself when no row asks for one, else a processed fp32 copy."""
    if not any(p.masked or p.logit_bias or p.min_tokens > n or p.penalized for p, n in zip(params, num_generated)):
        return logits
    out = logits.float().clone()
    token_masks.apply(out, params, num_generated, histories)
    _bias(out, params, num_generated)
    if histories is not None:
        _penalize(out, params, num_generated, histories)
    return out


def sample(
    logits: torch.Tensor,
    params: Sequence[Sampling],
    num_generated: Sequence[int],
    histories: Sequence[Sequence[int] | None] | None = None,
    race: Draw | None = None,
) -> list[int]:
    """One token per row of ``logits`` ``[S, vocab]``. ``histories``: each row's tokens so
    far (prompt + outputs), needed by rows with penalties. ``race``: the CPU backend's compiled draw for
    rows that keep the whole vocabulary (a ``paged_kernels.cpu_race.Draw``: ``Race``); without it, torch's."""
    raw = logits.float()
    logits = process(raw, params, num_generated, histories)
    if logits is not raw:
        # A row the processors left without a token (min_tokens masking the EOS that a grammar alone
        # allows, biases of -inf...) samples from its logits as they came (the grammar's mask included).
        dead = ~(logits > float("-inf")).any(dim=-1)
        if bool(dead.any()):
            logits[dead] = raw[dead]
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        dev = logits.device
        sel = torch.tensor(rows, device=dev)
        temps = torch.tensor([params[i].temperature for i in rows], device=dev)
        scaled = logits[sel] / temps[:, None]
        if any(params[i].min_p > 0 for i in rows):
            min_p = torch.tensor([params[i].min_p for i in rows], device=dev)
            scaled = torch.where((min_p > 0)[:, None], _min_p(scaled, min_p.clamp(min=1e-30)), scaled)
        top_k = torch.tensor([params[i].top_k for i in rows], device=dev)
        top_p = torch.tensor([params[i].top_p for i in rows], device=dev)
        vocab = scaled.shape[-1]
        filtered = [j for j, i in enumerate(rows) if 0 < params[i].top_k < vocab or params[i].top_p < 1.0]
        if len(filtered) == len(rows):
            tokens[sel] = _draw_candidates(scaled, top_k, top_p, rows, params, num_generated)
        elif not filtered:
            tokens[sel] = _draw_whole(scaled, rows, params, num_generated, race)
        else:
            whole = sorted(set(range(len(rows))) - set(filtered))
            f, w = torch.tensor(filtered, device=dev), torch.tensor(whole, device=dev)
            tokens[sel[f]] = _draw_candidates(
                scaled[f], top_k[f], top_p[f], [rows[j] for j in filtered], params, num_generated
            )
            tokens[sel[w]] = _draw_whole(scaled[w], [rows[j] for j in whole], params, num_generated, race)
    return tokens.tolist()


def _draw_candidates(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    rows: list[int],
    params: Sequence[Sampling],
    num_generated: Sequence[int],
) -> torch.Tensor:
    """Rows that top-k or top-p filter: noise for the surviving candidates only (a most-likely-first
    prefix of each row's candidates), hashed from (key, token id), all rows at once."""
    kept, ids = _candidates(scaled, top_k, top_p)
    assert ids is not None
    width = max(1, int((kept > float("-inf")).sum(dim=-1).max()))  # a row with no finite logit keeps one
    kept, ids = kept[:, :width], ids[:, :width]
    keys = _keys(rows, params, num_generated, scaled.device)
    pick = (kept.softmax(dim=-1) / noise(keys, ids)).argmax(dim=-1)
    return ids.gather(1, pick[:, None])[:, 0]


def _keys(
    rows: list[int], params: Sequence[Sampling], num_generated: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Each row's noise key: ``row_key`` of its seed and position; unseeded rows take theirs from torch's global
    generator."""
    fresh = torch.randint(-(1 << 63), (1 << 63) - 1, (len(rows),), dtype=torch.int64).tolist()
    return torch.tensor(
        [
            row_key(seed, num_generated[i]) if (seed := params[i].seed) is not None else fresh[j]
            for j, i in enumerate(rows)
        ],
        dtype=torch.int64,
        device=device,
    )


def _draw_whole(
    scaled: torch.Tensor,
    rows: list[int],
    params: Sequence[Sampling],
    num_generated: Sequence[int],
    race: Draw | None = None,
) -> torch.Tensor:
    """Rows that keep the whole vocabulary. With the CPU backend's ``race``: its compiled Gumbel-max over
    counter-based noise of (key, token id), one pass over each row (32 rows of 49,152 tokens: ~1.7 against ~32 ms).
    Otherwise a generator per seeded row (one Exp(1) draw per token). Either way the draw is a function of the
    request's seed and position only; the two draw different tokens for the same seed."""
    if race is not None and scaled.device.type == "cpu" and scaled.dtype == torch.float32:
        return race(scaled, _keys(rows, params, num_generated, scaled.device))
    probs = scaled.softmax(dim=-1)
    draws = torch.empty_like(probs)
    for j, i in enumerate(rows):
        gen = None
        if (seed := params[i].seed) is not None:
            gen = torch.Generator(device=scaled.device)
            gen.manual_seed((seed * _MIX + num_generated[i]) & _MASK63)
        draws[j].exponential_(generator=gen)
    return (probs / draws).argmax(dim=-1)
