"""Fuzzing the public API of one live stack (tiny Llama, real Redis and gRPC).

Hypothesis generates arbitrary ``GenerateRequest``s — every field, with extreme and
malformed values: NaN and infinite floats, u32/u64/i32 limits, negative numbers,
huge repeated fields, huge prompts, chat messages a strict template refuses — and
bytes no protobuf library would produce: lone surrogates and other invalid UTF-8
in string fields, unknown fields, truncations, bit flips, random bytes. ``Resume``
and ``Abort`` get the same treatment on a smaller scale. Each case is one call;
a stream that is served is cancelled after a couple of responses (which aborts
its request), so a huge ``max_tokens`` costs nothing.

Properties: no call ends INTERNAL or UNKNOWN, no call hangs (none runs into the
client's own deadline), no process dies and no task in one dies either (no
traceback in any service log), afterwards every KV block is free and nothing is
live, and a greedy request still matches transformers token for token.

Hypothesis draws batches: mostly one call, sometimes two to four at once, so that
cancellations, claims, deadlines and aborts of the same ids race. ``make test`` runs
a bounded number of batches (``BOUNDED_EXAMPLES``); ``PAGEDSERVE_FUZZ_EXAMPLES=N`` runs
N (``make fuzz``: 5000). The summary counts calls. Each run prints a
summary line and writes it as JSON to ``fuzz-summary.json`` in pytest's base temp
dir (and to ``$PAGEDSERVE_FUZZ_REPORT`` when set).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import grpc_healthy
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from tests.conftest import make_cluster
from tests.helpers import greedy, run_all, wait_all_free
from tests.test_e2e_oracle import hf_greedy

NS = "fuzz"
BOUNDED_EXAMPLES = 150  # batches of one to four calls: about 300 calls
EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES") or BOUNDED_EXAMPLES)
settings.register_profile(
    "pagedserve-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
FORBIDDEN = {grpc.StatusCode.INTERNAL.name, grpc.StatusCode.UNKNOWN.name}
SERVICE = "/pagedserve.v1.Generation/"
RESPONSES_READ = 2  # of a served stream, then it is cancelled
CALL_TIMEOUT_S = 60

U32, U64, I32 = 2**32 - 1, 2**64 - 1, 2**31 - 1
F32_MAX = 3.4028234663852886e38
# A stricter template than SmolLM2's: unknown roles and non-alternating turns raise, as
# many models' templates do (raise_exception is what transformers provides to templates).
STRICT_TEMPLATE = """\
{%- for message in messages -%}
{%- if message['role'] not in ['system', 'user', 'assistant'] -%}
{{ raise_exception('unknown role ' + message['role']) }}
{%- endif -%}
{%- set user_turn = loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0) -%}
{%- if message['role'] != 'system' and (message['role'] == 'user') != user_turn -%}
{{ raise_exception('roles must alternate user/assistant') }}
{%- endif -%}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}
"""


# ---------------------------------------------------------------- the stack
@pytest.fixture(scope="module")
def fuzz_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny Llama with the strict chat template."""
    dst = tmp_path_factory.mktemp("fuzz-model")
    for f in tiny_llama.iterdir():
        shutil.copy(f, dst / f.name)
    (dst / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    return dst


@pytest.fixture(scope="module")
def cluster(fuzz_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with make_cluster(fuzz_model, redis_url, NS, tmp_path_factory.mktemp("fuzz-logs"), blocks=64) as c:
        yield c


# ---------------------------------------------------------------- strategies
def extremes(*values: int) -> st.SearchStrategy[int]:
    return st.sampled_from(values)


u32 = st.one_of(extremes(0, 1, 2, 127, 128, 49151, 49152, I32, I32 + 1, U32), st.integers(0, U32))
u64 = st.one_of(extremes(0, 1, I32, U32, 2**53, 2**63 - 1, 2**63, U64), st.integers(0, U64))
i32 = st.one_of(extremes(-(2**31), -1, 0, 1, I32), st.integers(-(2**31), I32))
f32 = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-45, 1e-38, 3.4e38, -1.0, math.inf, -math.inf, math.nan, 1.0000001]),
    st.floats(width=32),
)
f64 = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-300, 0.001, 1.0, 1e300, 1.8e308, -1.0, math.inf, -math.inf, math.nan]), st.floats()
)
# Valid text only (protobuf refuses lone surrogates on serialisation; those go as raw bytes).
# "fixed-id\0..." once truncated to "fixed-id" inside Redis' Lua (fixed in validate.py).
IDS = ["x" * 256, "x" * 257, "a" * 100_000, "fixed-id", "fixed-id\x00tail", "\x00", "é", "id\nwith-newline"]
text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "",
            " ",
            "\x00",
            "{{ 1/0 }}",
            "{% for %}",
            "<|im_start|>",
            "<|im_end|>",
            "\u202e",
            "\U0010ffff",
            "é" * 100,
            "hello world",
        ]
    ),
)
token_ids = st.lists(u32, max_size=40) | st.lists(st.integers(0, 49151), min_size=1, max_size=500)


def huge(elements: st.SearchStrategy, sizes: tuple[int, ...]) -> st.SearchStrategy[list]:
    """One element repeated a huge number of times (lists hypothesis would take ages to draw)."""
    return st.tuples(elements, st.sampled_from(sizes)).map(lambda t: [t[0]] * t[1])


roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "", "USER", "{{role}}"]), text)
messages = st.lists(st.builds(pb.ChatMessage, role=roles, content=text), max_size=6) | huge(
    st.builds(pb.ChatMessage, role=st.just("user"), content=st.just("x")), (2_000, 300_000)
)


# Specs that compile: servable requests carry one of them now and then.
SPECS = [
    pb.StructuredOutput(json_schema='{"type": "object", "properties": {"a": {"enum": ["x", "y"]}}}'),
    pb.StructuredOutput(regex="[a-z]{1,3}"),
    pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no"])),
    pb.StructuredOutput(grammar='root ::= "a" root | "b"'),
    pb.StructuredOutput(json_object=True),
]
structured = st.one_of(
    st.builds(pb.StructuredOutput, json_schema=text | st.sampled_from(['{"type": "objectx"}', '{"$ref": "#"}', "[]"])),
    st.builds(pb.StructuredOutput, regex=text | st.sampled_from(["a(b", "(?=a)", "\\", "a{99999}"])),
    st.builds(pb.StructuredOutput, grammar=text | st.sampled_from(["root ::= x", "root ::= root"])),
    st.builds(pb.StructuredOutput, choice=st.builds(pb.Choices, choices=st.lists(text, max_size=5))),
    st.builds(pb.StructuredOutput, json_object=st.booleans()),
    st.just(pb.StructuredOutput()),
    st.sampled_from(SPECS),
)


@st.composite
def sampling(draw: st.DrawFn) -> pb.SamplingParams:
    kw: dict = {}
    for name, strat in (
        ("max_tokens", u32),
        ("temperature", f32),
        ("top_p", f32),
        ("top_k", i32),
        ("seed", u64),
        ("min_p", f32),
        ("presence_penalty", f32),
        ("frequency_penalty", f32),
        ("repetition_penalty", f32),
        ("min_tokens", u32),
        ("logprobs", u32),
        ("prompt_logprobs", u32),
        ("n", u32),
    ):
        if draw(st.booleans()):
            kw[name] = draw(strat)
    if draw(st.booleans()):
        kw["logit_bias"] = draw(st.dictionaries(u32, f32, max_size=5))
    kw["stop"] = draw(
        st.lists(text, max_size=20) | huge(st.just("stop"), (17, 10_000)) | huge(st.just("s" * 1000), (1, 16))
    )
    kw["stop_token_ids"] = draw(st.lists(u32, max_size=10) | huge(u32, (1_000, 200_000)))
    kw["ignore_eos"] = draw(st.booleans())
    if draw(st.booleans()):
        kw["structured_output"] = draw(structured)
    kw["include_stop_str_in_output"] = draw(st.booleans())
    kw["allowed_token_ids"] = draw(st.lists(u32, max_size=10) | huge(u32, (1_000, 200_000)))
    kw["bad_words"] = draw(st.lists(text, max_size=5) | huge(st.just("w"), (65, 10_000)))
    return pb.SamplingParams(**kw)


# JSON-like values for chat_template_kwargs (a Struct: NaN and infinities included).
json_values = st.recursive(
    st.none() | st.booleans() | f64 | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """Any GenerateRequest: zero, one or several prompt fields, every other field maybe."""
    req = pb.GenerateRequest()
    if draw(st.booleans()):
        req.request_id = draw(text | st.sampled_from(IDS))
    prompts = draw(st.sets(st.sampled_from(["prompt", "prompt_token_ids", "messages"]), max_size=3))
    if "prompt" in prompts:
        req.prompt = draw(text | st.sampled_from(["a " * 300, "a " * 100_000, "\U0001f600" * 50_000]))
    if "prompt_token_ids" in prompts:
        req.prompt_token_ids.extend(draw(token_ids | huge(u32, (511, 512, 100_000, 1_100_000))))
    if "messages" in prompts:
        req.messages.extend(draw(messages))
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling()))
    if draw(st.booleans()):
        req.priority = draw(i32)
    if draw(st.booleans()):
        req.queue_timeout = draw(f64)
    if draw(st.booleans()):
        req.add_generation_prompt = draw(st.booleans())
    req.continue_final_message = draw(st.booleans())
    if draw(st.booleans()):
        keys = text | st.sampled_from(["tokenize", "messages", "enable_thinking", "add_generation_prompt"])
        req.chat_template_kwargs.update(draw(st.dictionaries(keys, json_values, max_size=4)))
    if draw(st.booleans()):
        req.truncate_prompt_tokens = draw(i32)
    if draw(st.booleans()):
        _tools(draw, req)
    return req


SCHEMAS = ['{"type": "object", "properties": {"a": {"enum": ["x", "y"]}}}', "[]", "{", "NaN", '{"type": "objectx"}']


def _tools(draw: st.DrawFn, req: pb.GenerateRequest) -> None:
    """Tool calling's fields (issue 22): tools, a choice (any mode number, any name) and a history's calls."""
    names = st.sampled_from(["get_weather", "f", ""]) | text
    req.tools.extend(
        draw(
            st.lists(
                st.builds(
                    pb.Tool, name=names, description=text, parameters_json_schema=st.sampled_from(SCHEMAS) | text
                ),
                max_size=3,
            )
        )
    )
    if draw(st.booleans()):
        choice = st.builds(pb.ToolChoice, mode=st.integers(0, 5)) | st.builds(pb.ToolChoice, function_name=names)
        req.tool_choice.CopyFrom(draw(choice))
    if draw(st.booleans()):
        req.parallel_tool_calls = draw(st.booleans())
    for m in req.messages[:3]:
        args = st.sampled_from(['{"a": 1}', "{", "", "[1]"]) | text
        m.tool_calls.extend(draw(st.lists(st.builds(pb.ToolCall, id=text, name=names, arguments=args), max_size=2)))
        m.tool_call_id = draw(text)


@st.composite
def servable(draw: st.DrawFn) -> pb.GenerateRequest:
    """A request that passes validation, with every value at its extremes: these reach the
    loops and the executor's sampler (subnormal temperature and top_p, u64 seeds, ...)."""
    kind = draw(st.sampled_from(["prompt", "prompt_token_ids", "messages"]))
    req = pb.GenerateRequest()
    if kind == "prompt":
        req.prompt = draw(st.text(min_size=1, max_size=60).filter(str.strip) | st.just("hello world"))
    elif kind == "prompt_token_ids":
        req.prompt_token_ids.extend(draw(st.lists(st.integers(0, 49151), min_size=1, max_size=300)))
    else:
        turns = draw(st.lists(text, min_size=1, max_size=4))
        req.messages.extend(pb.ChatMessage(role=("user", "assistant")[i % 2], content=c) for i, c in enumerate(turns))
    s = req.sampling
    s.max_tokens = draw(st.integers(1, U32) | extremes(1, 2, U32))
    s.temperature = draw(st.floats(0, F32_MAX, width=32) | st.sampled_from([0.0, 1e-45, 1e-38, 1e-7, 3.4e38]))
    s.top_p = draw(st.floats(0, 1, width=32, exclude_min=True) | st.sampled_from([1e-45, 1e-7, 1.0]))
    s.top_k = draw(st.integers(0, I32) | extremes(0, 1, 49152, I32))
    if draw(st.booleans()):
        s.seed = draw(u64)
    s.stop.extend(draw(st.lists(st.text(min_size=1, max_size=8), max_size=4)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, 49151), max_size=4)))
    s.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):  # issue 12's options, anywhere in their domains
        s.min_p = draw(st.floats(0, 1, width=32) | st.sampled_from([0.0, 1e-45, 1.0]))
        s.presence_penalty = draw(st.floats(-2, 2, width=32))
        s.frequency_penalty = draw(st.floats(-2, 2, width=32))
        s.repetition_penalty = draw(
            st.floats(0, F32_MAX, width=32, exclude_min=True) | st.sampled_from([1e-45, 1.0, 3.4e38])
        )
        s.min_tokens = draw(st.integers(0, min(s.max_tokens, 64)))
        s.logit_bias.update(draw(st.dictionaries(st.integers(0, 49151), st.floats(-100, 100, width=32), max_size=4)))
        s.logprobs = draw(st.integers(0, 20))
        s.prompt_logprobs = draw(st.integers(0, 20))
    if not s.ignore_eos and draw(st.booleans()):
        s.structured_output.CopyFrom(draw(st.sampled_from(SPECS)))
    if draw(st.booleans()):  # issue 11's parallel sampling
        s.n = draw(st.integers(1, 4) | st.just(16))
    if draw(st.booleans()):  # issue 22's vLLM fields: token masks, kept stop strings, truncation
        s.include_stop_str_in_output = draw(st.booleans())
        s.allowed_token_ids.extend(draw(st.lists(st.integers(0, 49151), max_size=8)))
        s.bad_words.extend(draw(st.lists(st.text(min_size=1, max_size=12).filter(str.strip), max_size=4)))
        req.truncate_prompt_tokens = draw(st.integers(1, 400) | st.just(-1))
    req.priority = draw(i32)
    if draw(st.booleans()):
        req.queue_timeout = draw(st.floats(1e-300, 1e300) | st.sampled_from([1e-300, 1e-9, 30.0, 1e300]))
    if draw(st.booleans()):
        req.request_id = draw(st.sampled_from(["fixed-id", "other-id", *IDS]))
    return req


# Raw protobuf pieces for what the library will not serialise.
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(number: int, wire: int, payload: bytes) -> bytes:
    key = varint(number << 3 | wire)
    if wire == 2:
        return key + varint(len(payload)) + payload
    return key + payload


BAD_UTF8 = [b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xff", b"\xc0\xaf", b"\x80", b"a\xed\xb0\x80b", b"\xf4\x90\x80\x80"]


@st.composite
def malformed(draw: st.DrawFn) -> bytes:
    """A valid request's bytes with something wrong (or merely unknown) added."""
    base = draw(requests()).SerializeToString()
    bad = draw(st.sampled_from(BAD_UTF8))
    how = draw(
        st.sampled_from(
            ["bad-prompt", "bad-id", "bad-role", "bad-stop", "unknown", "truncate", "flip", "wrong-wire", "huge-length"]
        )
    )
    if how == "bad-prompt":
        return base + field(2, 2, b"hi " + bad)
    if how == "bad-id":
        return base + field(1, 2, bad)
    if how == "bad-role":
        return base + field(4, 2, field(1, 2, bad) + field(2, 2, b"x"))
    if how == "bad-stop":
        return base + field(5, 2, field(6, 2, bad))
    if how == "unknown":
        number = draw(st.integers(8, 2**29 - 1).filter(lambda n: not 19000 <= n <= 19999))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        payload = {
            0: varint(draw(u64)),
            1: struct.pack("<Q", draw(u64)),
            5: struct.pack("<I", draw(u32)),
            2: draw(st.binary(max_size=64)),
        }[wire]
        nested = draw(st.booleans())  # also inside SamplingParams
        extra = field(number, wire, payload)
        return base + (field(5, 2, extra) if nested else extra)
    if how == "truncate":
        cut = draw(st.integers(0, max(0, len(base) - 1)))
        return base[:cut]
    if how == "flip":
        if not base:
            return b"\xff"
        i = draw(st.integers(0, len(base) - 1))
        return base[:i] + bytes([base[i] ^ (1 << draw(st.integers(0, 7)))]) + base[i + 1 :]
    if how == "wrong-wire":
        number = draw(st.integers(1, 7))
        wire = draw(st.sampled_from([0, 1, 5] if number in (1, 2, 4, 5) else [1, 2, 5]))
        return base + field(number, wire, {0: b"\x01", 1: b"\x00" * 8, 2: b"\x01\x02", 5: b"\x00" * 4}[wire])
    return base + varint(2 << 3 | 2) + varint(2**31) + b"abc"  # a length past the end


case = st.one_of(
    requests().map(lambda r: ("generate", "request", r.SerializeToString())),
    servable().map(lambda r: ("generate", "servable", r.SerializeToString())),
    malformed().map(lambda b: ("generate", "malformed", b)),
    st.binary(max_size=256).map(lambda b: ("generate", "random-bytes", b)),
    st.builds(pb.ResumeRequest, request_id=text | st.just("fixed-id"), offset=u32).map(
        lambda r: ("resume", "request", r.SerializeToString())
    ),
    st.builds(pb.ResumeRequest, request_id=st.just("fixed-id"), offset=st.integers(0, 8), index=u32).map(
        lambda r: ("resume", "index", r.SerializeToString())
    ),
    st.builds(pb.AbortRequest, request_id=text | st.just("fixed-id")).map(
        lambda r: ("abort", "request", r.SerializeToString())
    ),
    st.binary(max_size=64).map(lambda b: ("resume", "random-bytes", b)),
    st.binary(max_size=64).map(lambda b: ("abort", "random-bytes", b)),
)
# Mostly one call at a time; sometimes several at once (cancellations racing claims,
# deadlines and aborts of the same ids).
CONCURRENT = 4
batches = st.one_of(case.map(lambda c: [c]), st.lists(case, min_size=2, max_size=CONCURRENT))


# ---------------------------------------------------------------- one case
HUNG = "hung"  # the call ran into the client's own deadline


async def call(channel: grpc.aio.Channel, method: str, payload: bytes) -> str:
    """Send raw bytes; the name of the status the server ended the call with (OK included),
    CANCELLED when we stopped reading a served stream, HUNG past our own deadline."""

    def status(e: grpc.aio.AioRpcError) -> str:
        # grpcio's own deadline says exactly this; the server's names the queue deadline.
        deadline = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and e.details() == "Deadline Exceeded"
        return HUNG if deadline else e.code().name

    if method == "abort":
        try:
            await channel.unary_unary(SERVICE + "Abort")(payload, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return status(e)
        return "OK"
    stream = channel.unary_stream(SERVICE + method.capitalize())(payload, timeout=CALL_TIMEOUT_S)
    read = 0
    try:
        async for _ in stream:
            read += 1
            if read >= RESPONSES_READ:
                stream.cancel()
                return "CANCELLED"
    except grpc.aio.AioRpcError as e:
        return status(e)
    return "OK"


async def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def call_batch(channel: grpc.aio.Channel, batch: list[tuple[str, str, bytes]]) -> list[str]:
    """The batch's calls at once. A guard past the calls' own deadline catches a client that
    never noticed it (a hang either way)."""

    async def one(method: str, payload: bytes) -> str:
        try:
            return await asyncio.wait_for(call(channel, method, payload), CALL_TIMEOUT_S + 30)
        except TimeoutError:
            return HUNG

    return list(await asyncio.gather(*(one(m, p) for m, _, p in batch)))


class Logs:
    """What the services logged since the last look."""

    def __init__(self, paths: list[Path]) -> None:
        self.offsets = {p: p.stat().st_size for p in paths}

    def new(self) -> str:
        out = []
        for path, offset in self.offsets.items():
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            self.offsets[path] = offset + len(chunk)
            out.append(chunk.decode(errors="replace"))
        return "".join(out)


def describe(payload: bytes) -> str:
    try:
        req = pb.GenerateRequest.FromString(payload)
    except Exception:  # noqa: BLE001 - malformed on purpose
        return f"{len(payload)} raw bytes: {payload[:200]!r}"
    text_form = str(req)
    return text_form if len(text_form) < 2000 else text_form[:2000] + "..."


# ---------------------------------------------------------------- the campaign
def test_fuzz_public_api(
    cluster: Cluster, fuzz_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    counts: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    procs = [*cluster.schedulers, *cluster.executors]
    logs = Logs([p.log_path for p in procs if p.log_path is not None])

    loop = asyncio.new_event_loop()
    channel = loop.run_until_complete(open_channel(cluster.address))
    try:

        @settings(settings.get_profile("pagedserve-fuzz"))
        @given(batch=batches)
        def fuzz(batch: list[tuple[str, str, bytes]]) -> None:
            results = loop.run_until_complete(call_batch(channel, batch))
            for (method, kind, payload), code in zip(batch, results):
                counts[f"{method}/{kind}"] += 1
                codes[code] += 1
                assert code not in FORBIDDEN, f"{method} answered {code} to {describe(payload)}"
                assert code != HUNG, f"{method} hung on {describe(payload)}"
            what = "; ".join(f"{method} of {describe(payload)}" for method, _, payload in batch)
            dead = [p.proc.args[2] for p in procs if p.proc.poll() is not None]
            assert not dead, f"{dead} died on {what}"
            logged = logs.new()
            assert "Traceback" not in logged, f"{what} (or a call before) raised:\n{logged}"

        fuzz()
    finally:
        loop.run_until_complete(channel.close())
        loop.close()

    total = sum(counts.values())
    summary = {"cases": total, "by_kind": dict(sorted(counts.items())), "status_codes": dict(sorted(codes.items()))}
    line = f"fuzz: {total} cases ran against the live stack; " + json.dumps(summary)
    print(line)
    reports = [tmp_path_factory.getbasetemp() / "fuzz-summary.json"]
    if os.environ.get("PAGEDSERVE_FUZZ_REPORT"):
        reports.append(Path(os.environ["PAGEDSERVE_FUZZ_REPORT"]))
    for path in reports:
        path.write_text(json.dumps(summary, indent=2) + "\n")
    assert total >= min(EXAMPLES, 50), summary
    assert codes["CANCELLED"] > 0 and codes["INVALID_ARGUMENT"] > 0, (
        "the campaign never got a request served"
    )  # the campaign ran, not just its first example

    # Nothing died, nothing leaked, and the model still answers exactly.
    assert all(p.proc.poll() is None for p in procs)
    assert all(grpc_healthy(p.address) for p in procs)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        free, totals = wait_all_free(client, NS)
    finally:
        client.close()
    assert free == totals, (free, totals)
    prompt = list(range(300, 333))
    [res] = run_all(cluster.address, [greedy(prompt, 10, ignore_eos=True)])
    assert res.token_ids == hf_greedy(fuzz_model, [prompt], [10])[0]


@pytest.mark.parametrize("request_id", ["fixed-id\x00tail", "\x00", "é", "line\nbreak"])
def test_request_ids_outside_printable_ascii_are_refused(cluster: Cluster, request_id: str) -> None:
    """Found by this campaign: an id with a NUL was cut short inside Redis' Lua (string.format),
    so its queue entry named another (or no) request: the loop that claimed it crashed and
    the stream hung. Ids also travel in gRPC metadata, which takes printable ASCII only."""
    req = pb.GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7])
    with grpc.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(ch.unary_stream(SERVICE + "Generate")(req.SerializeToString(), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in info.value.details()


def test_a_refused_duplicate_or_a_second_stream_leaves_the_first_stream_alone(cluster: Cluster, redis_url: str) -> None:
    """Found by this campaign: the replica's event routing kept one queue per request id, so a
    second Generate with a running id (refused: ALREADY_EXISTS) or a Resume of it on the same
    replica took the first stream's events away, and that stream hung until its deadline."""
    req = greedy(list(range(400, 430)), 24, ignore_eos=True)
    req.request_id = "shared-id"

    async def go() -> tuple[list[str], list[int], list[int]]:
        async with grpc.aio.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
            gen = ch.unary_stream(
                SERVICE + "Generate",
                request_serializer=pb.GenerateRequest.SerializeToString,
                response_deserializer=pb.GenerateResponse.FromString,
            )
            resume = ch.unary_stream(
                SERVICE + "Resume",
                request_serializer=pb.ResumeRequest.SerializeToString,
                response_deserializer=pb.GenerateResponse.FromString,
            )

            async def tokens(call) -> list[int] | str:
                try:
                    return [t async for r in call for t in r.token_ids]
                except grpc.aio.AioRpcError as e:
                    return e.code().name

            results = await asyncio.gather(*(tokens(gen(req, timeout=60)) for _ in range(3)))
            codes = sorted(r if isinstance(r, str) else "OK" for r in results)
            served = next(r for r in results if not isinstance(r, str))
            # A Generate and a Resume of it, both on this replica, both to the end.
            req.request_id = "shared-id-2"
            first = gen(req, timeout=60)
            async for _ in first:
                break  # it runs: now resume it from the start alongside
            both = await asyncio.gather(
                tokens(first), tokens(resume(pb.ResumeRequest(request_id="shared-id-2"), timeout=60))
            )
            return codes, served, both

    codes, served, (rest, resumed) = asyncio.run(go())
    assert codes == ["ALREADY_EXISTS", "ALREADY_EXISTS", "OK"], codes
    assert len(served) == 24
    assert isinstance(resumed, list) and len(resumed) == 24 and resumed[-len(rest) :] == rest, (rest, resumed)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        free, totals = wait_all_free(client, NS)
    finally:
        client.close()
    assert free == totals
