"""The Redis schema of the scheduler state, one owner for the Python and the Lua side.

Key names are ``pagedserve.keys``' (``Keys``, ``ExecutorKeys``): the Python that builds a key
is the only place its name is written (``pagedserve status`` and the membership read them
there too). This module owns the rest of the layout: the queue members, the streams'
lengths, the events the frontends read, a commit's operations and how they travel. It
renders all of it into the Lua scripts of ``lua.py`` when a store loads them
(``render``), so a script writes no key name, offset, length or JSON of its own.

A script names an item of the schema as ``${name}`` or ``${name(arg, ...)}``, which renders
to a Lua expression of the script's variables:

- keys: ``${queue}`` (``Keys.queue``), ``${req(rid)}`` (``Keys.req(rid)``), ``${x_live(eid)}``
  (``Keys.executor(eid).live``); each is built from the script's ``p``, the namespace's
  ``Keys.prefix``, which every script that builds keys receives;
- ``${queue_member(arrival, rid)}`` and ``${queue_request_id(member)}``: the queue's members;
- ``${finished_event(rid, reason, n)}``: ``Event.encode`` of one finished request;
- the constants of ``CONSTANTS``: ``${EVENTS_MAXLEN}``, ``${FILL}``...
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.keys import INCOMING_MAXLEN, ExecutorKeys, Keys
from scheduler_svc.core.logprob import Logprob

RESULT_TTL_S = 600  # finished requests stay readable (and resumable) this long, by default
EVENTS_MAXLEN = 100_000  # the events stream is capped at about this many entries
# and the doorbell stream at INCOMING_MAXLEN (pagedserve.keys: executors ring it too)
EVICTED_KEEP_MS = 86_400_000  # an evicted executor is remembered (never led again) this long

# A queue member is "<arrival, zero-padded>:<request id>", so that members sort by arrival;
# the arrival part is printf-style, read alike by Python's % and Lua's string.format.
QUEUE_ARRIVAL = "%016d:"
QUEUE_ID_AT = len(QUEUE_ARRIVAL % 0)  # where the request id starts

# A step's commit is one list of commands (commit.CommitWriter); the apply script runs two
# operations itself rather than as one Redis command:
FILL = "FILL"  # FILL key n: a bitmap of n one-bits (a tier's blocks, all free)
BITS = "BITS"  # BITS key value "b1,b2,...": SETBIT key b value for each b
MAX_OP_ARGS = 4000  # values per command: the script unpacks each, and Lua's unpack() stops near 8000
# (A commit's words are Redis arguments, which the client packs one by one: BITS sends its
# blocks, often thousands, as one word.)


def queue_member(arrival: int, request_id: str) -> str:
    return QUEUE_ARRIVAL % arrival + request_id


def request_id_of(member: str) -> str:
    """The request id of a queue member."""
    return member[QUEUE_ID_AT:]


def commit_args(ops: list[list[str]]) -> list[str]:
    """A commit's commands as the apply script reads them after its epoch and sequence: per
    command its length, then its words; payloads (events, pool views) stay plain strings."""
    return [word for op in ops for word in (str(len(op)), *op)]


@dataclass(slots=True)
class Event:
    """One step's news for the frontends. ``tokens``: request -> (offset in the
    completion of the first token, tokens); ``finished``: request -> (reason,
    completion length). Offsets let a reader drop what it has and notice a gap."""

    tokens: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    finished: dict[str, tuple[str, int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)  # one entry per token, with sampling.logprobs
    cached: dict[str, int] = field(default_factory=dict)  # finished request -> prompt tokens from the prefix cache

    def encode(self) -> str:
        d: dict[str, object] = {}
        if self.tokens:
            d["t"] = {rid: [off, *toks] for rid, (off, toks) in self.tokens.items()}
        if self.logprobs:
            d["l"] = self.logprobs
        if self.finished:
            d["f"] = {
                rid: [reason, n, *([self.cached[rid]] if self.cached.get(rid) else [])]
                for rid, (reason, n) in self.finished.items()
            }
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def decode(cls, data: str) -> Event:
        d = json.loads(data)
        finished = d.get("f", {})
        return cls(
            {rid: (v[0], v[1:]) for rid, v in d.get("t", {}).items()},
            {rid: (v[0], int(v[1])) for rid, v in finished.items()},
            {rid: [Logprob.of(e) for e in entries] for rid, entries in d.get("l", {}).items()},
            {rid: int(v[2]) for rid, v in finished.items() if len(v) > 2},
        )

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finished)


# -- the Lua side ------------------------------------------------------------------

CONSTANTS: dict[str, int | str] = {
    "EVENTS_MAXLEN": EVENTS_MAXLEN,
    "INCOMING_MAXLEN": INCOMING_MAXLEN,
    "EVICTED_KEEP_MS": EVICTED_KEEP_MS,
    "FILL": FILL,
    "BITS": BITS,
}

# Keys are rendered from what Python builds for this namespace and, where a key names a
# request or an executor, for this id: they stand for the script's ``p`` and argument.
_SAMPLE = Keys("ns")
_ID = "\x00id\x00"


def lua_string(text: str) -> str:
    """``text`` as a Lua string literal."""
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\x00", "\\0")
    return f"'{escaped}'"


def _concat(parts: list[str]) -> str:
    return "(" + " .. ".join(parts) + ")"


def _key(key: str, arg: str | None = None) -> str:
    """A key Python built for the sample namespace (and id), as a Lua expression of ``p`` (and ``arg``)."""
    if not key.startswith(_SAMPLE.prefix) or key.count(_ID) != int(arg is not None):
        raise ValueError(f"not a key of one namespace and at most one id: {key!r}")
    head, _, tail = key[len(_SAMPLE.prefix) :].partition(_ID)
    parts = ["p", lua_string(head)] + ([arg, lua_string(tail)] if arg is not None else [])
    return _concat([x for x in parts if x != "''"])


def _request_key(build: Callable[[str], str], rid: str) -> str:
    return _key(build(_ID), rid)


def _executor_key(name: str, eid: str) -> str:
    return _key(getattr(_SAMPLE.executor(_ID), name), eid)


def _queue_member(arrival: str, rid: str) -> str:
    return _concat([f"string.format({lua_string(QUEUE_ARRIVAL)}, {arrival})", rid])


def _queue_request_id(member: str) -> str:
    return f"string.sub({member}, {QUEUE_ID_AT + 1})"  # Lua counts from 1


def _finished_event(rid: str, reason: str, n: str) -> str:
    """``Event.encode`` of one finished request, with its id, reason and length from the script:
    Python encodes one with stand-ins for the three, which become Lua expressions."""
    text = Event(finished={"\x00rid": ("\x00reason", 987654321)}).encode()
    values = {json.dumps("\x00rid"): f"cjson.encode({rid})", json.dumps("\x00reason"): f"cjson.encode({reason})"}
    values["987654321"] = n
    pieces = re.split("(" + "|".join(map(re.escape, values)) + ")", text)
    if sorted(x for x in pieces if x in values) != sorted(values):
        raise ValueError(f"Event.encode of one finished request is not one of each value: {text!r}")
    return _concat([values[x] if x in values else lua_string(x) for x in pieces if x])


def _constant(value: int | str) -> str:
    return str(value) if isinstance(value, int) else lua_string(value)


def _items() -> dict[str, Callable[..., str]]:
    """Every name a script may use, and what renders it."""
    items: dict[str, Callable[..., str]] = {}
    for name, key in vars(_SAMPLE).items():
        if name not in ("namespace", "prefix"):
            items[name] = functools.partial(_key, key, None)
    for name in ("req", "out", "logprobs", "prompt_logprobs", "member"):
        items[name] = functools.partial(_request_key, getattr(_SAMPLE, name))
    for name, attr in vars(ExecutorKeys).items():
        if isinstance(attr, property):
            items[f"x_{name}"] = functools.partial(_executor_key, name)
    items["queue_member"] = _queue_member
    items["queue_request_id"] = _queue_request_id
    items["finished_event"] = _finished_event
    for name, value in CONSTANTS.items():
        items[name] = functools.partial(_constant, value)
    return items


ITEMS = _items()
_PLACEHOLDER = re.compile(r"\$\{(\w+)(?:\(([^)]*)\))?\}")


@functools.cache
def render(template: str) -> str:
    """A script's template with every ``${...}`` replaced by what the schema says."""

    def one(m: re.Match[str]) -> str:
        if m[1] not in ITEMS:
            raise ValueError(f"{m[0]}: the schema defines no {m[1]!r}")
        args = [a.strip() for a in m[2].split(",")] if m[2] is not None else []
        return ITEMS[m[1]](*args)

    text = _PLACEHOLDER.sub(one, template)
    if "${" in text:
        raise ValueError(f"a placeholder the schema cannot read: {text[text.index('${') :][:40]!r}")
    return text
