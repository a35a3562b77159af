"""Structured output, piece by piece: compiling specs (xgrammar, SmolLM2's real tokenizer),
the executor's matchers on fixed logits (masking, completion, rebuild from history, rollback,
refusals that never raise), the plan's history through preemption, and the request checks."""

from __future__ import annotations

import json

import pytest
import torch

from executor_svc.grammar import Grammars, Row
from pagedserve.grammar import Compiler, GrammarError, choice_ebnf
from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.core.request import Params, Request
from scheduler_svc.frontend.validate import Caps, InvalidArgument, structured
from scheduler_svc.loops.plan import PlanBuilder
from scheduler_svc.state import codec
from tests.unit.executor_svc.conftest import EOS, VOCAB
from tests.unit.scheduler_svc.core.test_scheduler import make, req


def ids(tok: object, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)  # type: ignore[operator]


@pytest.mark.parametrize(
    "spec,why",
    [
        (("json_schema", '{"type": "objectx"}'), "objectx"),
        (("json_schema", "{not json"), "not valid JSON"),
        (("regex", "a(b"), "parenthesis"),
        (("ebnf", "root ::= foo"), "foo"),
        (("yaml", "a: 1"), "unknown grammar kind"),
    ],
)
def test_a_spec_that_does_not_compile_says_why(compiler: Compiler, spec: tuple[str, str], why: str) -> None:
    with pytest.raises(GrammarError, match=why) as info:
        compiler.compile(spec)
    assert "/project/cpp" not in str(info.value), "xgrammar's source location is cut"


def test_choices_with_quotes_backslashes_and_newlines_match_exactly(compiler: Compiler, tok: object) -> None:
    choices = ['say "hi"', "back\\slash", "two\nlines", "héllo"]
    grammar = ("ebnf", choice_ebnf(choices))
    for c in choices:
        m = compiler.matcher(grammar)
        assert all(m.accept_token(t) for t in ids(tok, c)) and m.accept_token(EOS) and m.is_terminated()
    m = compiler.matcher(grammar)
    assert not all(m.accept_token(t) for t in ids(tok, "say hi"))


class Executor:
    """Drives ``Grammars`` the way ``Engine.step`` does, one sequence per step, on fixed logits."""

    def __init__(self, compiler: Compiler) -> None:
        self.g = Grammars(lambda: compiler, VOCAB, [EOS])

    def step(
        self,
        rid: str,
        spec: tuple[str, str],
        token_ids: list[int],
        start_pos: int,
        num_generated: int,
        logits: torch.Tensor,
        full_table: bool = False,
        history: list[int] | None = None,
    ) -> int:
        self.g.observe(rid, spec, token_ids, start_pos, full_table, history or [])
        rows = [Row(0, rid, spec, start_pos + len(token_ids), num_generated)]
        logits = logits.clone()[None]
        self.g.apply(logits, self.g.start(rows, 1).result(), rows)
        tokens = logits.argmax(-1).tolist()
        self.g.accept(rows, tokens)
        return tokens[0]

    def mask(self, rid: str, spec: tuple[str, str], end: int, num_generated: int) -> torch.Tensor:
        return self.g.start([Row(0, rid, spec, end, num_generated)], 1).result()[0]


def run(
    ex: Executor, rid: str, spec: tuple[str, str], prompt: list[int], logits: torch.Tensor, max_tokens: int
) -> list[int]:
    """Prefill then decode until EOS; returns the output tokens."""
    out: list[int] = []
    t = ex.step(rid, spec, prompt, 0, 0, logits, full_table=True)
    while True:
        out.append(t)
        if t == EOS or len(out) == max_tokens:
            return out
        t = ex.step(rid, spec, [t], len(prompt) + len(out) - 1, len(out), logits)


def favour(tok: object, text: str) -> torch.Tensor:
    """Logits that prefer the tokens of ``text`` above everything, EOS least."""
    logits = torch.zeros(VOCAB)
    logits[ids(tok, text)] = 10.0
    logits[EOS] = -5.0
    return logits


def test_masked_output_follows_the_regex_then_only_eos(compiler: Compiler, tok: object) -> None:
    ex = Executor(compiler)
    spec = ("regex", "[0-9]{3}")
    out = run(ex, "r", spec, [1, 5, 9], favour(tok, "abc"), max_tokens=10)
    assert out[-1] == EOS and len(out) <= 4
    assert all(c.isdigit() for c in tok.decode(out[:-1])) and len(tok.decode(out[:-1])) == 3  # type: ignore[attr-defined]
    # A further step after the end (a pipelined loop may run one and discard it): EOS, no error.
    n = len(out)
    assert ex.step("r", spec, [EOS], 3 + n - 1, n, favour(tok, "abc")) == EOS
    assert ex.g.stats.broken == 0


def feed(ex: Executor, rid: str, spec: tuple[str, str], prompt: list[int], outputs: list[int]) -> None:
    """Run the prompt, then the steps that sampled ``outputs`` (as if the sampler picked them)."""
    for i, t in enumerate(outputs):
        token_ids = prompt if i == 0 else [outputs[i - 1]]
        start = 0 if i == 0 else len(prompt) + i - 1
        ex.g.observe(rid, spec, token_ids, start, i == 0)
        rows = [Row(0, rid, spec, len(prompt) + i, i)]
        ex.g.start(rows, 1).result()
        got = [t]
        ex.g.accept(rows, got)
        assert got == [t], "the grammar accepts every output fed"


def test_a_matcher_rebuilt_from_history_masks_as_the_original(compiler: Compiler, tok: object) -> None:
    """A new leader or a swap-in sends the full table with history: the new matcher stands where
    the old one stood."""
    spec = (
        "json_schema",
        json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}),
    )
    prompt, text = [1, 5, 9], ids(tok, '{"name": "Al')
    n = len(text)
    a = Executor(compiler)
    feed(a, "r", spec, prompt, text)
    a.g.observe("r", spec, [text[-1]], len(prompt) + n - 1, False)
    before = a.mask("r", spec, len(prompt) + n, n)
    b = Executor(compiler)
    history = prompt + text[:-1]
    b.g.observe("r", spec, [text[-1]], len(history), True, history)
    after = b.mask("r", spec, len(prompt) + n, n)
    assert torch.equal(before, after) and b.g.stats.rebuilds == 1 and b.g.stats.broken == 0
    assert not torch.equal(after, torch.full_like(after, -1)), "mid-string, not everything is allowed"


def test_a_plan_that_steps_back_rolls_the_matcher_back(compiler: Compiler, tok: object) -> None:
    """A pipelined loop that discards a step reruns it: the matcher undoes the token it accepted."""
    spec = ("regex", "[a-z]+[0-9]+")
    prompt, out = [1, 5], ids(tok, "abc")[:1] * 3
    ref = Executor(compiler)
    feed(ref, "r", spec, prompt, out[:2])
    ref.g.observe("r", spec, [out[1]], len(prompt) + 1, False)
    expected = ref.mask("r", spec, len(prompt) + 2, 2)
    ex = Executor(compiler)
    feed(ex, "r", spec, prompt, out)  # accepted 3
    rebuilds = ex.g.stats.rebuilds
    ex.g.observe("r", spec, [out[1]], len(prompt) + 1, False)  # the step that sampled the third, again
    assert torch.equal(ex.mask("r", spec, len(prompt) + 2, 2), expected)
    assert ex.g.stats.rebuilds == rebuilds and ex.g.stats.broken == 0, "rolled back, not rebuilt"


def test_a_rejected_token_or_unknown_tokens_end_the_row_with_eos(compiler: Compiler, tok: object) -> None:
    spec = ("regex", "[0-9]+")
    ex = Executor(compiler)
    ex.g.observe("r", spec, [1, 5], 0, True)
    rows = [Row(0, "r", spec, 2, 0)]
    ex.g.start(rows, 1).result()
    tokens = [ids(tok, "x")[0]]  # as if a sampler ignored the mask
    ex.g.accept(rows, tokens)
    assert tokens == [EOS] and ex.g.stats.broken == 1
    assert ex.step("r", spec, [EOS], 2, 1, favour(tok, "7")) == EOS, "broken: only EOS from then on"
    # A full table past the start with no history: the tokens are unknown, the row ends with EOS.
    ex.g.observe("s", spec, [7], 9, True, [])
    assert ex.step("s", spec, [7], 9, 3, favour(tok, "7"), full_table=True) == EOS
    assert ex.g.stats.broken == 2


def test_forget_and_clear_drop_matchers(compiler: Compiler) -> None:
    g = Grammars(lambda: compiler, VOCAB, [EOS])
    g.observe("a", ("regex", "a"), [1], 0, True)
    g.observe("b", ("regex", "b"), [1], 0, True)
    g.forget("a")
    assert "a" not in g and "b" in g
    g.clear()
    assert "b" not in g


@pytest.mark.parametrize("mode,cpu", [("recompute", 0), ("swap", 8)])
def test_the_executor_knows_each_structured_request_s_tokens_through_preemption(mode: str, cpu: int) -> None:
    """Plans (diffs, full tables with history after swap-ins and recomputes) drive the executor's
    record of the tokens: at every sampling step it equals prompt + output so far."""
    s = make(blocks=6, cpu=cpu, preemption_mode=mode, max_num_batched_tokens=6)
    spec = ("regex", ".*")
    for i, rid in enumerate("ab"):
        s.add(req(rid, 8, max_tokens=12, arrival=i, grammar=spec))
    plans, g = PlanBuilder(), Grammars(lambda: None, VOCAB, [EOS])  # type: ignore[arg-type,return-value]
    ended: list[str] = []
    histories = checked = 0
    while s.has_work:
        out = s.schedule()
        plan = plans.build(out, 0, ended)
        if plan.reset_tables:
            g.clear()
        for rid in plan.forget:
            g.forget(rid)
        for seq in plan.seqs:
            assert (seq.sampling.grammar.kind, seq.sampling.grammar.spec) == spec
            histories += bool(seq.history)
            assert not seq.history or (seq.full_table and seq.start_pos == len(seq.history))
            g.observe(seq.request_id, spec, list(seq.token_ids), seq.start_pos, seq.full_table, list(seq.history))
            if seq.sample:
                r = s.requests[seq.request_id]
                assert g._entries[seq.request_id].tokens == r.prompt_ids + r.output_ids[: seq.num_generated]
                assert seq.start_pos + len(seq.token_ids) - seq.num_generated == len(r.prompt_ids)
                checked += 1
        ended = [r.request_id for r in s.update(out, {x.req.request_id: 7 for x in out.scheduled if x.samples})]
    assert checked >= 24
    if mode == "swap":
        assert histories > 0, "a swap-in resends the table with the history"


def test_history_only_for_structured_requests_with_a_full_table_past_the_start() -> None:
    s = make(blocks=16)
    s.add(req("plain", 8, max_tokens=4))
    s.add(req("json", 8, max_tokens=4, arrival=1, grammar=("json_object", "")))
    builder = PlanBuilder()
    out = s.schedule()
    first = builder.build(out, 0, [])
    assert all(not seq.history for seq in first.seqs), "start_pos 0: nothing before"
    assert {seq.request_id: seq.sampling.grammar.kind for seq in first.seqs} == {"plain": "", "json": "json_object"}
    s.update(out, {"plain": 7, "json": 7})
    fresh = PlanBuilder()  # a new leader: full tables again
    second = fresh.build(s.schedule(), 1, [])
    hist = {seq.request_id: list(seq.history) for seq in second.seqs}
    assert hist == {"plain": [], "json": s.requests["json"].prompt_ids}


def test_the_spec_survives_redis() -> None:
    r = Request("x", [1, 2], Params(max_tokens=5, grammar=("regex", "a+")))
    back = codec.request_from("x", {"spec": codec.spec_json(r, [])}, [])
    assert back.params == r.params
    plain = Request("y", [1], Params())
    assert codec.request_from("y", {"spec": codec.spec_json(plain, [])}, []).params.grammar is None


def _so(**kw: object) -> pb.SamplingParams:
    return pb.SamplingParams(structured_output=pb.StructuredOutput(**kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "sampling,field",
    [
        (pb.SamplingParams(structured_output=pb.StructuredOutput()), "sampling.structured_output:"),
        (_so(json_schema=""), "sampling.structured_output.json_schema:"),
        (_so(choice=pb.Choices()), "sampling.structured_output.choice:"),
        (_so(choice=pb.Choices(choices=["a", ""])), "sampling.structured_output.choice:"),
        (_so(json_object=False), "sampling.structured_output.json_object:"),
        (_so(regex="a" * 101), "sampling.structured_output.regex: 101 bytes"),
        (pb.SamplingParams(ignore_eos=True, structured_output=pb.StructuredOutput(regex="a")), "sampling.ignore_eos:"),
    ],
)
def test_bad_structured_output_names_the_field(sampling: pb.SamplingParams, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        structured(sampling, Caps(max_grammar_bytes=100))
    assert str(info.value).startswith(field), str(info.value)


def test_structured_output_kinds() -> None:
    assert structured(pb.SamplingParams()) == (None, "")
    assert structured(_so(json_schema="{}")) == (("json_schema", "{}"), "sampling.structured_output.json_schema")
    assert structured(_so(grammar='root ::= "a"'))[0] == ("ebnf", 'root ::= "a"')
    assert structured(_so(choice=pb.Choices(choices=["x", "y"])))[0] == ("ebnf", 'root ::= "x" | "y"')
    assert structured(_so(json_object=True))[0] == ("json_object", "")


def test_the_torch_fallback_masks_as_xgrammar(compiler: Compiler, tok: object) -> None:
    import xgrammar as xgr

    from executor_svc.grammar import apply_torch

    g = Grammars(lambda: compiler, VOCAB, [EOS])
    g.observe("r", ("regex", "[0-9]+x"), [1, 5], 0, True)
    g.observe("s", ("json_object", ""), [1, 5], 0, True)
    rows = [Row(0, "r", ("regex", "[0-9]+x"), 2, 0), Row(2, "s", ("json_object", ""), 2, 0)]
    bitmask = g.start(rows, 3).result()
    logits = torch.randn(3, VOCAB)
    a, b = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(a, bitmask, vocab_size=VOCAB, indices=[0, 2])
    apply_torch(b, bitmask, [0, 2], VOCAB)
    assert torch.equal(a, b) and torch.equal(b[1], logits[1]), "row 1 has no grammar: untouched"
    assert torch.isinf(b[0]).sum() > VOCAB - 100


def test_a_compiler_that_cannot_load_ends_rows_with_eos_not_the_step() -> None:
    def broken() -> Compiler:
        raise RuntimeError("no tokenizer here")

    g = Grammars(broken, VOCAB, [EOS])
    g.observe("r", ("regex", "a"), [1, 5], 0, True)
    rows = [Row(0, "r", ("regex", "a"), 2, 0)]
    bitmask = g.start(rows, 1).result()
    assert g.stats.broken == 1 and int((bitmask != 0).sum()) == 1, "one word is not zero: EOS's"
    assert bitmask[0, EOS // 32] == 1 << (EOS % 32), "only EOS is allowed"
    tokens = [7]
    g.accept(rows, tokens)
    assert tokens == [EOS]
