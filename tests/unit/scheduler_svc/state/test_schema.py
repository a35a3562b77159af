"""The Lua scripts take every key, offset, stream length and the event format from the schema
(``scheduler_svc.state.schema``): each template renders, writes none of them by hand, and what
it renders builds the same strings as the Python (``tests/test_store.py`` runs them on Redis)."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.keys import ExecutorKeys, Keys
from pagedserve.tiers import TIERS
from scheduler_svc.state import lua, schema
from scheduler_svc.state.schema import Event

TEMPLATES = {name: text for name, text in vars(lua).items() if name.isupper() and isinstance(text, str)}
# What Python builds a key from, in the Lua: anything joined to the namespace's prefix or an
# executor's, a quoted key name, a queue member's layout, a stream length, an event's JSON.
BY_HAND = re.compile(r"\b[px] \.\.|'(?:x|req|out|lp|plp|exec|free):|string\.sub\(|'%0\d+d|'MAXLEN', '~', '?\d|cjson")


def _eval(expr: str, bindings: dict[str, str]) -> str:
    """A rendered key or event: a Lua concatenation of literals, variables and ``cjson.encode(var)``."""
    out = []
    for part in expr.removeprefix("(").removesuffix(")").split(" .. "):
        if part.startswith("'"):
            out.append(part[1:-1].replace("\\'", "'").replace("\\\\", "\\"))
        elif m := re.fullmatch(r"cjson\.encode\((\w+)\)", part):
            out.append(json.dumps(bindings[m[1]]))
        else:
            out.append(bindings[part])
    return "".join(out)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_script_renders_and_writes_nothing_of_the_schema_by_hand(name: str) -> None:
    text = schema.render(TEMPLATES[name])
    assert "${" not in text
    assert not BY_HAND.search(TEMPLATES[name]), BY_HAND.search(TEMPLATES[name])


def test_a_name_the_schema_does_not_define_is_refused() -> None:
    with pytest.raises(ValueError, match="no 'quueue'"):
        schema.render("redis.call('ZCARD', ${quueue})")
    with pytest.raises(TypeError):
        schema.render("redis.call('HGETALL', ${req})")  # a request's key needs the request


def test_every_key_the_lua_builds_is_the_one_python_builds() -> None:
    k, rid, eid = Keys("ns-1"), "req'\\:é", "exec-7"
    x = k.executor(eid)
    expected = {name: (getattr(k, name), None) for name in vars(k) if name not in ("namespace", "prefix")}
    expected |= {
        name: (getattr(k, name)(rid), "rid") for name in ("req", "out", "logprobs", "prompt_logprobs", "member")
    }
    names = [name for name, attr in vars(ExecutorKeys).items() if isinstance(attr, property)]
    expected |= {f"x_{name}": (getattr(x, name), "eid") for name in names}
    assert {key for key, _ in expected.values() if key.startswith(x.prefix)} | {x.free(t) for t in TIERS} == set(
        x.all()
    )
    for name, (key, arg) in expected.items():
        assert name in schema.ITEMS, f"the schema renders no {name!r} for the Lua"
        lua_expr = schema.ITEMS[name](*([arg] if arg else []))
        assert _eval(lua_expr, {"p": k.prefix, "rid": rid, "eid": eid}) == key, name


def test_the_lua_event_of_a_finished_request_is_event_encode() -> None:
    expr = schema.ITEMS["finished_event"]("rid", "reason", "n")
    rid = 'a"b\\c'
    text = _eval(expr, {"rid": rid, "reason": "abort", "n": "3"})
    assert text == Event(finished={rid: ("abort", 3)}).encode()
    assert Event.decode(text) == Event(finished={rid: ("abort", 3)})


def test_one_queue_member_layout() -> None:
    member = schema.queue_member(42, "r:1")
    assert member == "0000000000000042:r:1" and schema.request_id_of(member) == "r:1"
    assert schema.ITEMS["queue_request_id"]("qk") == f"string.sub(qk, {schema.QUEUE_ID_AT + 1})"


def test_a_commit_is_one_flat_list_of_commands() -> None:
    ops = [["HSET", "k", "f", '{"a":[1]}'], [schema.BITS, "b", "1", "3,5"], ["DEL", "x"]]
    assert schema.commit_args(ops) == [
        *("4", "HSET", "k", "f", '{"a":[1]}'),
        *("4", "BITS", "b", "1", "3,5"),
        *("2", "DEL", "x"),
    ]
