"""Pure mappings between the scheduler's objects and what Redis stores: request hashes, the
queue's entries, the events frontends read, pool views.

Nothing here talks to Redis. The commands one step commits are ``commit.py``'s; the Lua
scripts in ``lua.py`` that write the same fields follow the same shapes (tests check the two
against each other on a real server). Key names, the queue members' layout, stream lengths and
the event format are ``schema``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from pagedserve.lora import Adapter
from pagedserve.tiers import Tier
from scheduler_svc.core.migration import Ask, KvSource, Lent, Offer
from scheduler_svc.core.placement import Candidate, PoolView
from scheduler_svc.core.record import StepRecord
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.state.schema import (
    Event,
    queue_member,
    request_id_of,
)

# -- requests -------------------------------------------------------------------


def spec_json(req: Request, stop: list[str]) -> str:
    """The immutable part of a request."""
    p = req.params
    params: dict[str, object] = {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "seed": p.seed,
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
    }
    # The newer options only when set: a spec keeps the shape older replicas read.
    params.update({k: getattr(p, k) for k, default in _EXTRA_DEFAULTS.items() if getattr(p, k) != default})
    if p.logit_bias:
        params["logit_bias"] = [list(x) for x in p.logit_bias]
    if p.grammar:
        params["grammar"] = list(p.grammar)
    if p.allowed_token_ids:
        params["allowed_token_ids"] = list(p.allowed_token_ids)
    if p.bad_words:
        params["bad_words"] = [list(w) for w in p.bad_words]
    extra: dict[str, object] = {"salt": req.cache_salt} if req.cache_salt else {}
    if req.group:
        extra["group"] = [req.group, req.index]
    if req.lora is not None:
        extra["lora"] = [req.lora.name, req.lora.path, req.lora.digest, req.lora.rank]
    return json.dumps({"prompt": req.prompt_ids, "priority": req.priority, "stop": stop, **extra, "params": params})


_EXTRA_DEFAULTS: dict[str, object] = {
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "n": 1,
    "include_stop_str_in_output": False,
}


def request_from(request_id: str, fields: dict[str, str], output: list[str], computed: int = 0) -> Request:
    spec = json.loads(fields["spec"])
    params = spec["params"]
    params["stop_token_ids"] = tuple(params["stop_token_ids"])
    params["logit_bias"] = tuple((int(t), float(b)) for t, b in params.get("logit_bias", ()))
    if params.get("grammar"):
        params["grammar"] = tuple(params["grammar"])
    params["allowed_token_ids"] = tuple(params.get("allowed_token_ids", ()))
    params["bad_words"] = tuple(tuple(w) for w in params.get("bad_words", ()))
    group, index = spec.get("group", ("", 0))
    lora = spec.get("lora")
    return Request(
        request_id=request_id,
        prompt_ids=spec["prompt"],
        params=Params(**params),
        priority=spec["priority"],
        arrival=int(fields.get("arrival", 0)),
        output_ids=[int(t) for t in output],
        status=Status(fields.get("status", Status.WAITING)),
        num_computed=computed,
        blocks=[int(b) for b in fields.get("blocks", "").split(",") if b],
        swap_blocks=[(Tier(int(t)), int(b)) for t, b in (x.split(":") for x in fields.get("swap", "").split(",") if x)],
        num_preemptions=int(fields.get("preemptions", 0)),
        deadline_ms=int(fields.get("dl") or 0),
        cache_salt=spec.get("salt"),
        num_cached=int(fields.get("cached") or 0),
        group=group,
        index=index,
        lora=Adapter(str(lora[0]), str(lora[1]), str(lora[2]), int(lora[3])) if lora else None,
        kv=kv_from(fields.get("kv", "")),
    )


def _refs(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(t), int(b)) for t, b in (x.split(":") for x in text.split(",") if x))


def _refs_text(blocks: object) -> str:
    return ",".join(f"{int(t)}:{b}" for t, b in blocks)  # type: ignore[attr-defined]


def kv_json(src: KvSource) -> str:
    """A request hash's ``kv`` field: where its KV is lent (core/migration.py)."""
    return json.dumps(
        {
            "x": src.executor,
            "a": src.address,
            "e": src.epoch,
            "l": src.lend,
            "b": _refs_text(src.blocks),
            "n": src.tokens,
            "at": src.at_ms,
            "c": src.cause,
            "to": src.to,
        }
    )


def kv_from(text: str) -> KvSource | None:
    if not text:
        return None
    d = json.loads(text)
    return KvSource(
        d["x"],
        d["a"],
        int(d["e"]),
        d["l"],
        _refs(d["b"]),
        int(d["n"]),
        int(d["at"]),
        d.get("c", "drain"),
        d.get("to", ""),
    )


def offer_json(offer: Offer) -> str:
    """An ``offer`` doorbell's data: the lend to pull and the cache names of its blocks."""
    return json.dumps({"kv": kv_json(offer.src), "h": ",".join(offer.hashes), "s": offer.start, "r": offer.reserve})


def offer_from(to: str, request_id: str, text: str) -> Offer:
    d = json.loads(text)
    src = kv_from(d["kv"])
    assert src is not None
    return Offer(to, request_id, src, tuple(h for h in d["h"].split(",") if h), int(d["s"]), int(d.get("r", 0)))


def ask_json(ask: Ask) -> str:
    """An ``ask`` doorbell's data: who asks, for which hashes of the request's prefix."""
    return json.dumps({"r": ask.reader, "h": ",".join(ask.hashes), "s": ask.start})


def ask_from(to: str, request_id: str, text: str) -> Ask:
    d = json.loads(text)
    return Ask(to, request_id, d["r"], tuple(h for h in d["h"].split(",") if h), int(d["s"]))


def lent_json(lent: Lent) -> str:
    """An executor's ``lent`` hash entry: what a new leader frees (its executor forgets the lend)."""
    return json.dumps({"r": lent.request_id, "b": _refs_text(lent.blocks), "d": lent.deadline_ms})


def lent_blocks(text: str) -> tuple[tuple[int, int], ...]:
    return _refs(json.loads(text)["b"])


def stop_of(fields: dict[str, str]) -> list[str]:
    """The request's stop strings (the frontend applies them)."""
    return list(json.loads(fields["spec"])["stop"])


@dataclass(slots=True)
class Claimed:
    """A request a loop took from the queue, as the claim script returned it."""

    req: Request
    cancel: Finish | None  # a frontend's pending abort or stop
    submitted_ms: int  # when it was submitted
    traceparent: str  # its root span, if tracing is on


def cancel_of(fields: dict[str, str]) -> Finish | None:
    """A frontend's pending ``abort`` or ``stop`` for this request, if any."""
    return Finish(fields["cancel"]) if fields.get("cancel") else None


def queue_entry(arrival: int, request_id: str, priority: int, policy: str) -> tuple[float, str]:
    """(score, member) in the shared queue: members sort by arrival (schema.queue_member,
    as the submit script writes them), scores by priority under the priority policy."""
    return (float(priority) if policy == "priority" else 0.0), queue_member(arrival, request_id)


def hashes_field(hashes: list[str]) -> str:
    """A request's prompt block hashes (core/prefix.prompt_hashes) as the submit script stores them."""
    return ",".join(hashes)


def hits_from(text: str) -> dict[str, int]:
    """The peek script's ``executor=blocks,...``: how many of a request's leading blocks each executor caches."""
    out: dict[str, int] = {}
    for item in text.split(",") if text else []:
        executor, _, n = item.rpartition("=")
        out[executor] = int(n)
    return out


def candidate_from(row: list[str]) -> Candidate:
    """A row of the peek script: queue key, prompt length, max_tokens, priority, tokens generated,
    the prefix hits per executor (``hits_from``), the LoRA adapter's digest ('' for the base model) and
    the executor its KV was pre-copied to ('' for none: ``KvSource.to``)."""
    qk, plen, maxt, prio, nout, *rest = row
    return Candidate(
        qk,
        request_id_of(qk),
        int(plen),
        int(plen) + int(nout),
        int(maxt),
        int(prio),
        hits_from(rest[0] if rest else ""),
        rest[1] if len(rest) > 1 else "",
        rest[2] if len(rest) > 2 else "",
    )


def free_blocks(bitmap: bytes, total: int) -> list[int]:
    """The free block ids a tier's bitmap holds (bit ``b``, most significant first in each byte)."""
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8))[:total]
    return np.flatnonzero(bits).tolist()


# -- events ---------------------------------------------------------------------


def event_of(rec: StepRecord) -> Event:
    ev = Event()
    ended = {r.request_id: r for r in rec.finished}
    for rid, toks in rec.new_tokens.items():
        req = rec.touched.get(rid) or ended[rid]
        ev.tokens[rid] = (len(req.output_ids) - len(toks), toks)
    ev.logprobs = dict(rec.logprobs)
    for r in rec.finished:
        ev.finished[r.request_id] = ((r.finish_reason or Finish.ABORT).value, len(r.output_ids))
        if r.num_cached:
            ev.cached[r.request_id] = r.num_cached
    return ev


def entry_json(entry: object) -> str:
    """A logprobs entry (``plan.entry``) as stored in Redis."""
    return json.dumps(entry, separators=(",", ":"))


# -- pool views -----------------------------------------------------------------


def view_json(v: PoolView) -> str:
    return json.dumps(
        {
            "serving": v.serving,
            "block_size": v.block_size,
            "blocks": v.blocks,
            "free": v.free,
            "running": v.running,
            "swapped": v.swapped,
            "max_model_len": v.max_model_len,
            "max_num_seqs": v.max_num_seqs,
            "watermark": v.watermark,
            "held": {str(p): n for p, n in v.held.items()},
            **({"loras": [v.max_loras, *v.adapters]} if v.max_loras else {}),
            **({"role": v.role} if v.role != "mixed" else {}),
            **({"loaded": v.loaded} if v.loaded else {}),
        },
        separators=(",", ":"),
    )


def view_from(executor: str, data: str) -> PoolView:
    d = json.loads(data)
    return PoolView(
        executor,
        d["serving"],
        d["block_size"],
        tuple(d["blocks"]),
        tuple(d["free"]),
        d["running"],
        d["swapped"],
        d["max_model_len"],
        d["max_num_seqs"],
        d["watermark"],
        {int(p): n for p, n in d["held"].items()},
        max_loras=d["loras"][0] if "loras" in d else 0,
        adapters=tuple(d["loras"][1:]) if "loras" in d else (),
        role=d.get("role", "mixed"),
        loaded=tuple(d.get("loaded", ())),
    )
