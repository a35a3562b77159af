"""Speculative decoding's scheduler side on plain data: ``--speculative-config``, the proposers, the
draft length policy, and the scheduler's lookahead, partial acceptance and rollback.

``Model`` plays the executor: a deterministic next-token function of the tokens so far (a greedy
model), verifying drafts as the executor does (accept while the model agrees, then its own token),
so an output with drafts must equal the output without.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedserve.executor.v1 import executor_pb2 as pb
from scheduler_svc.core import spec
from scheduler_svc.core.blocks import BlockManager, Pool
from scheduler_svc.core.draft_length import expected_tokens
from scheduler_svc.core.logprob import Logprob
from scheduler_svc.core.output import SchedulerOutput
from scheduler_svc.core.request import Finish, Params, Request, Status
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.loops.flights import Flight, Pipeline
from scheduler_svc.loops.plan import PlanBuilder, outputs
from tests.unit.scheduler_svc.core.test_group import check_refs
from tests.unit.scheduler_svc.core.test_scheduler import check_blocks

EOS = 99
NGRAM = spec.SpecConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
SUFFIX = spec.SpecConfig("suffix", 4, suffix_decoding_max_tree_depth=8)


# -- the config ---------------------------------------------------------------------------


def test_parse_takes_vllms_json() -> None:
    c = spec.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 4, 4)
    c = spec.parse('{"method": "suffix"}')
    assert c.num_speculative_tokens == c.suffix_decoding_max_tree_depth == 24
    assert c.measure_step_cost and c.compute_bound_tokens == 256  # the measured cost's prior
    c = spec.parse('{"method": "suffix", "compute_bound_tokens": 64}')
    assert not c.measure_step_cost and c.compute_bound_tokens == 64  # given: the model, fixed
    assert not spec.Speculator.of(c).policy.cost.measured
    assert c.adaptive_draft_length and spec.Speculator.of(c).policy.adaptive
    c = spec.parse('{"method": "ngram", "num_speculative_tokens": 3, "adaptive_draft_length": false}')
    assert not c.adaptive_draft_length and not spec.Speculator.of(c).policy.adaptive


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("{", "not JSON"),
        ("[]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "max"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "draft_model": "x"}', "draft_model"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "suffix_decoding_min_token_prob"),
        ('{"method": "suffix", "adaptive_draft_length": "no"}', "adaptive_draft_length"),
    ],
)
def test_parse_refuses_naming_the_key(text: str, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        spec.parse(text)


# -- the proposers --------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_earlier_suffix() -> None:
    toks = [1, 2, 3, 4, 5, 9, 2, 3, 4]
    assert spec.ngram(toks, 1, 3, 3) == [5, 9, 2]  # "2 3 4" occurred at 1; what followed it
    assert spec.ngram(toks, 1, 3, 10) == [5, 9, 2, 3, 4]  # cut at the end of the tokens
    assert spec.ngram([1, 2, 3, 7, 3], 1, 3, 2) == [7, 3]  # only "3" matches
    assert spec.ngram([1, 2, 3], 1, 3, 2) == []  # nothing repeats
    assert spec.ngram(toks, 4, 5, 3) == []  # no suffix of 4 or more occurred before
    assert spec.ngram([5, 5, 5, 5], 2, 2, 2) == [5, 5]  # the earliest occurrence
    # Token ids whose bytes overlap across positions must not match misaligned.
    assert spec.ngram([256, 1, 0, 1], 1, 1, 1) == [0]
    assert spec.ngram([1 << 8, 1], 1, 1, 1) == []


def test_suffix_proposes_the_most_frequent_continuation() -> None:
    p = spec.SuffixProposer(depth=8, min_prob=0.1)
    toks = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]
    # "1 2" (the longest suffix seen before) was followed by 3 twice and by 4 once; the draft is as
    # long as the match (spec_factor 1).
    assert p.propose("r", toks, 3) == [3, 1]
    # The longest match decides before frequency: "2 3 4 1 2" occurred once, followed by 3 5 1.
    toks = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2]
    assert p.propose("r2", toks, 3) == [3, 5, 1]
    assert p.propose("r2", [*toks, 3], 1) == [5]  # incremental: the new token is indexed
    assert p.propose("other", [7, 8], 3) == []
    # A finished request's output is remembered for the others, bounded.
    p.finished("r", [7, 8, 9, 10])
    assert p.propose("other", [7, 8], 3) == [9, 10]
    q = spec.SuffixProposer(depth=8, max_cached=1)
    q.finished("a", [7, 8, 9])
    q.finished("b", [1, 1])
    assert q.propose("c", [7, 8], 2) == []  # evicted
    assert q._cache is not None and set(q._cache.root.kids) == {1}


def test_suffix_draft_length_follows_the_match() -> None:
    p = spec.SuffixProposer(depth=16, spec_factor=1.0)
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    assert p.propose("r", toks, 5) == [2]  # a one-token match drafts one token
    assert p.propose("s", [*toks, 2, 3], 5) == [4, 5, 6]


def test_a_long_match_leaves_room_for_drafts() -> None:
    """A quoted passage matched as deep as the trie goes leaves one token below it; a shorter suffix of
    the match, whose continuation is as sure, drafts more."""
    p = spec.SuffixProposer(depth=8, spec_factor=1.0)
    passage = list(range(100, 120))
    toks = [*passage, 7, *passage[:9]]  # the request quotes the passage: its last 9 tokens occurred before
    assert p.propose("r", toks, 6) == passage[9:12]  # a 7-token match drafts 1; its last 3 (by halves) draft 3


# -- the draft length, driven by the scheduler ---------------------------------------------


def test_no_drafts_while_the_proposer_finds_none_then_it_tries_again() -> None:
    """Text that repeats nothing: prompt lookup finds no drafts, so the policy stops asking (the loop
    pipelines again instead of waiting for each result to draft from it), and later tries again."""
    s = make(cfg=spec.SpecConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=2))
    r = Request("r", list(range(100, 140)), Params(max_tokens=200))
    s.add(r)
    s.update(s.schedule(), {"r": 1000})
    assert s.spec is not None and s.wants_drafts()
    asked = []
    for i in range(120):  # every token new: nothing to look up
        asked.append(s.wants_drafts())
        out = s.schedule()
        assert not out.has_drafts
        s.update(out, {"r": 1001 + i})
    assert s.spec.policy.coverage < 0.2
    stopped = asked.index(False)
    assert 3 <= stopped <= 20, "it asked a few times (a request's first tokens repeat nothing yet), then stopped"
    assert any(asked[stopped:]), "and tried again later"
    assert sum(asked) < len(asked) / 4


def test_only_all_decode_steps_are_measured() -> None:
    s = make()
    r = Request("r", [5, 6, 7, 8, 5, 6, 7], Params(max_tokens=20))
    s.add(r)
    out = s.schedule()  # the prompt: not a decode step
    s.update(out, {"r": 8})
    s.observe_step(out, 100.0, 0.0)
    assert s.spec is not None and not s.spec.policy.cost._ranges
    out = s.schedule()
    assert out.scheduled[0].drafts
    s.update(out, {"r": 5}, more={"r": []})
    s.observe_step(out, 30.0, 2.0)
    assert s.spec.policy.cost._ranges == {
        (1 + len(out.scheduled[0].drafts)).bit_length(): (1.0, 1.0 + len(out.scheduled[0].drafts), 30.0)
    }
    assert s.spec.policy.cost._waits == {True: (1.0, 2.0)}


def test_a_drafting_steps_outcome_counts_the_tokens_its_drafts_are_expected_to_give() -> None:
    """A row with 4 drafts, at the measured acceptance alpha, is expected to give expected_tokens(alpha, 4)
    tokens; in a step of 60 ms where the curve has a plain step at 30 ms that is half of it per ms
    (``Outcomes``), whatever this one step accepted."""
    s = make()
    r = Request("r", [5, 6, 7, 8, 5, 6, 7], Params(max_tokens=20))
    s.add(r)
    s.update(s.schedule(), {"r": 8})
    assert s.spec is not None
    for _ in range(4):
        for t in range(1, 6):  # a flat step: the weights' reading
            s.spec.policy.cost.observe(t, 30.0, t > 1, 0.0)
    out = s.schedule()
    assert len(out.scheduled[0].drafts) == 4
    s.update(out, {"r": 5}, more={"r": [6, 7]})
    s.observe_step(out, 60.0, 0.0)
    rng = s.spec.policy.outcomes._ranges[1]
    alpha = s.spec.policy.alpha
    assert rng.weight == 1.0 and rng.gains == pytest.approx(expected_tokens(alpha, 4) * 30 / 60)


# -- the scheduler ----------------------------------------------------------------------------


Next = Callable[[list[int]], int]


def cyclic(tokens: list[int]) -> int:
    """A model that repeats its prompt's last 5 tokens (drafts are accepted), with a twist every
    7th position (some are rejected)."""
    n = len(tokens)
    return 40 + n % 3 if n % 7 == 0 else tokens[n - 5]


def make(
    blocks: int = 64, cfg: spec.SpecConfig | None = NGRAM, caching: bool = False, cpu: int = 0, **kw: object
) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=4096,
        eos_token_ids=(EOS,),
        watermark=0.0,
        spec=cfg,
        enable_prefix_caching=caching,
        **kw,  # type: ignore[arg-type]
    )
    return Scheduler(config, BlockManager(4, Pool.fresh(blocks), Pool.fresh(cpu), caching=caching))


def step(s: Scheduler, model: Next) -> SchedulerOutput:
    """One step, the executor played by ``model``: drafts verified as the executor does."""
    out = s.schedule()
    first: dict[str, int] = {}
    more: dict[str, list[int]] = {}
    for x in out.scheduled:
        if not x.samples:
            continue
        ctx = x.req.prompt_ids + x.req.output_ids
        emitted = []
        for j in range(len(x.drafts) + 1):
            t = model(ctx + x.drafts[:j])
            emitted.append(t)
            if j == len(x.drafts) or t != x.drafts[j]:
                break
        first[x.req.request_id] = emitted[0]
        if x.drafts:
            more[x.req.request_id] = emitted[1:]
    s.update(out, first, more=more)
    if any(r.group for r in s.requests.values()):
        check_refs(s)  # group mates share blocks
    else:
        check_blocks(s)
    for r in s.running:  # no block is held for positions past the next token
        assert len(r.blocks) <= -(-(r.num_tokens) // 4)
    return out


def run(s: Scheduler, reqs: list[Request], model: Next, steps: int = 500) -> dict[str, list[int]]:
    for r in reqs:
        s.add(r)
    for _ in range(steps):
        if not s.has_work:
            break
        step(s, model)
    assert not s.has_work
    return {r.request_id: r.output_ids for r in reqs}


def requests(n: int = 3, max_tokens: int = 40, **kw: object) -> list[Request]:
    return [
        Request(f"r{i}", [10 + i, 11, 12, 13, 14 + i] * 3, Params(max_tokens=max_tokens, **kw))  # type: ignore[arg-type]
        for i in range(n)
    ]


@pytest.mark.parametrize("cfg", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_outputs_with_drafts_equal_outputs_without(cfg: spec.SpecConfig) -> None:
    plain = run(make(cfg=None), requests(), cyclic)
    s = make(cfg=cfg)
    assert run(s, requests(), cyclic) == plain
    c = s.counters
    assert c.spec_drafts > 0 and 0 < c.spec_accepted_tokens < c.spec_draft_tokens
    assert c.steps < make(cfg=None).counters.steps + 200  # sanity
    assert s.blocks.num_free() == s.blocks.total()


def test_fewer_steps_with_drafts() -> None:
    off, on = make(cfg=None), make()
    run(off, requests(1), cyclic)
    run(on, requests(1), cyclic)
    assert on.counters.steps < off.counters.steps * 0.6


def test_partial_acceptance_counts_only_accepted_tokens() -> None:
    s = make()
    r = Request("r", [5, 6, 7, 8, 5, 6, 7], Params(max_tokens=20))
    s.add(r)
    out = s.schedule()
    s.update(out, {"r": 8})  # prefill; samples 8
    assert r.num_computed == 7
    out = s.schedule()
    (x,) = out.scheduled
    assert x.drafts == [5, 6, 7, 8] and x.num_tokens == 5 and x.start == 7
    assert len(r.blocks) == 3  # positions 0..11: lookahead reserved
    s.update(out, {"r": 5}, more={"r": [6, 9]})  # accepted 5, 6; then 9 instead of 7
    assert r.output_ids == [8, 5, 6, 9]
    assert r.num_computed == 10  # 7 + the last sampled token + 2 accepted
    assert r.num_pending == 1 and len(r.blocks) == 3  # the block of position 10 (next token) stays
    rec = s.take_record()
    assert rec.new_tokens == {"r": [8, 5, 6, 9]}
    assert (rec.counters.spec_drafts, rec.counters.spec_draft_tokens, rec.counters.spec_accepted_tokens) == (1, 4, 2)
    assert rec.spec_accepted_per_pos == [1, 1, 0, 0]


def test_rejected_lookahead_blocks_are_freed() -> None:
    s = make(blocks=8)
    r = Request("r", [1, 2, 3, 1, 2, 3], Params(max_tokens=20))
    s.add(r)
    s.update(s.schedule(), {"r": 1})  # 6 prompt tokens and the output 1: positions 0..6
    out = s.schedule()
    (x,) = out.scheduled
    assert x.drafts == [2, 3, 1]  # at positions 7..9: the third block is reserved for them
    assert len(r.blocks) == 3 and s.blocks.num_free() == 5
    s.update(out, {"r": 9})  # the first draft is rejected: 9 goes to position 7, in the second block
    assert r.output_ids == [1, 9] and r.num_computed == 7
    assert len(r.blocks) == 2 and s.blocks.num_free() == 6
    check_blocks(s)
    out = s.schedule()
    (x,) = out.scheduled
    s.update(out, {"r": 4}, more={"r": x.drafts[:1]} if x.drafts else {})
    s.finish("r", Finish.ABORT)
    assert s.blocks.num_free() == 8


def test_a_finish_among_accepted_drafts_truncates() -> None:
    s = make()
    r = Request("r", [1, 2, 3, 1, 2, EOS, 1, 2], Params(max_tokens=20))
    s.add(r)
    s.update(s.schedule(), {"r": 3})
    out = s.schedule()
    (x,) = out.scheduled
    assert x.drafts[:2] == [1, 2]
    s.update(out, {"r": 1}, more={"r": [2, EOS, 1]})
    assert r.output_ids == [3, 1, 2, EOS] and r.status == Status.FINISHED and r.finish_reason == Finish.STOP
    assert s.blocks.num_free() == s.blocks.total()


def test_drafts_never_pass_max_tokens_or_the_budget() -> None:
    s = make(max_num_batched_tokens=3)
    r = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], Params(max_tokens=3))
    s.add(r)
    while not r.output_ids:  # 8 prompt tokens over a budget of 3: chunked
        s.update(s.schedule(), {"r": 3})
    out = s.schedule()
    (x,) = out.scheduled
    assert len(x.drafts) == 1  # max_tokens 3, one output so far: this step yields at most 2
    s.update(out, {"r": 1}, more={"r": [2]})
    assert r.output_ids == [3, 1, 2] and r.finish_reason == Finish.LENGTH


def test_logprobs_come_with_every_token_of_a_row_with_drafts() -> None:
    s = make()
    r = Request("r", [1, 2, 3, 1, 2], Params(max_tokens=20, logprobs=1))
    s.add(r)
    s.update(s.schedule(), {"r": 3}, {"r": Logprob(3, -0.1, 1, (), ())})
    s.take_record()
    out = s.schedule()
    assert out.scheduled[0].drafts == [1, 2, 3]
    lp = [Logprob(t, -0.5, 1, (), ()) for t in (1, 2, 6)]
    s.update(out, {"r": 1}, {"r": lp[0]}, None, {"r": [2, 6]}, {"r": lp[1:]})
    rec = s.take_record()
    assert rec.new_tokens["r"] == [1, 2, 6] and rec.logprobs["r"] == lp


def test_no_drafts_while_the_last_token_is_in_flight() -> None:
    s = make()
    r = Request("q", [1, 2, 3, 1, 2], Params(max_tokens=20))
    s.add(r)
    s.update(s.schedule(), {"q": 3})
    out = s.schedule()
    assert out.scheduled[0].drafts
    s.launch(out)
    assert r.num_computed == 6  # the drafts count once accepted
    nxt = s.schedule()  # planned while the drafting plan is in flight (a pipelined loop never does)
    assert not any(x.drafts for x in nxt.scheduled)


def test_under_preemption_and_prefix_caching() -> None:
    plain = run(make(cfg=None, blocks=14), requests(4, 30), cyclic)
    for cfg in (NGRAM, SUFFIX):
        s = make(cfg=cfg, blocks=14)
        assert run(s, requests(4, 30), cyclic) == plain
        assert s.counters.preemptions_recompute > 0 and s.counters.spec_accepted_tokens > 0
        s = make(cfg=cfg, blocks=14, caching=True)
        assert run(s, requests(4, 30), cyclic) == plain
        assert s.counters.spec_accepted_tokens > 0
        s = make(cfg=cfg, blocks=14, cpu=64, preemption_mode="swap")
        assert run(s, requests(4, 30), cyclic) == plain
        assert s.counters.preemptions_swap > 0 and s.counters.spec_accepted_tokens > 0


def test_prefix_cache_names_only_accepted_tokens() -> None:
    s = make(caching=True)
    r = Request("r", [1, 2, 3, 1, 2, 3, 1], Params(max_tokens=30))
    s.add(r)
    s.update(s.schedule(), {"r": 2})
    out = s.schedule()
    assert out.scheduled[0].drafts == [3, 1, 2]
    s.update(out, {"r": 9})  # rejected: positions 8.. hold nothing that counts
    assert r.num_registered == 2  # positions 0..7: two full blocks; the third is not named
    assert len(s.blocks.cached) == 2
    out = s.schedule()
    s.update(out, {"r": 5}, more={"r": []})
    assert r.output_ids[-2:] == [9, 5]


# -- the plan and the pipelined loop -------------------------------------------------------------


def test_the_plan_carries_drafts_and_resends_a_trimmed_table() -> None:
    s = make(blocks=8)
    r = Request("r", [1, 2, 3, 1, 2, 3], Params(max_tokens=20))
    s.add(r)
    plans = PlanBuilder()
    out = s.schedule()
    plans.build(out, 0, [])
    s.update(out, {"r": 1})
    out = s.schedule()
    plan = plans.build(out, 1, [])
    (seq,) = plan.seqs
    assert list(seq.token_ids) == [1] and list(seq.draft_token_ids) == [2, 3, 1] and seq.start_pos == 6
    assert not seq.full_table and list(seq.block_table) == [r.blocks[2]]  # the lookahead block
    pipe = Pipeline(2)
    pipe.add(Flight.of(out, 1))
    assert not pipe.can_launch(), "a drafting plan is not followed by another in flight"
    # The executor rejected every draft: the third block is freed, and the next plan's table goes whole.
    result = pb.StepResult()
    result.outputs.add(request_id="r", token_id=9)
    s.update(out, *outputs(result))
    assert len(r.blocks) == 2
    out = s.schedule()
    (seq,) = plans.build(out, 2, []).seqs
    assert seq.full_table and list(seq.block_table) == r.blocks
    pipe.flights.clear()
    pipe.add(Flight.of(out, 2))
    assert pipe.can_launch() == (not out.has_drafts)


def test_the_executors_tables_follow_trims_and_new_lookahead() -> None:
    """Every plan's table diffs, applied as the executor applies them, give each scheduled request the
    table the scheduler planned with, while rejected drafts free lookahead blocks, other requests take
    them, and the next drafts reserve new ones. (A diff after a trim once named only the blocks past
    the old length: the executor kept the freed block, wrote the drafts' KV into another request's
    block and read its own from there; SmolLM2's outputs at batch 32 diverged from transformers.)"""
    s = make(blocks=40)
    for r in requests(6, 40):
        s.add(r)
    plans, tables, ended = PlanBuilder(), dict[str, list[int]](), list[str]()
    trims = 0
    for step_id in range(400):
        if not s.has_work:
            break
        out = s.schedule()
        plan = plans.build(out, step_id, ended)
        for rid in plan.forget:
            tables.pop(rid, None)
        for seq in plan.seqs:
            if seq.full_table:
                tables[seq.request_id] = list(seq.block_table)
            else:
                tables[seq.request_id] += list(seq.block_table)
        for x in out.scheduled:
            assert tables[x.req.request_id] == x.req.blocks, f"step {step_id}: {x.req.request_id}'s table"
        held = {rid: len(s.requests[rid].blocks) for rid in s.requests}
        first, more = {}, {}
        for x in out.scheduled:
            ctx = x.req.prompt_ids + x.req.output_ids
            emitted = []
            for j in range(len(x.drafts) + 1):
                emitted.append(cyclic(ctx + x.drafts[:j]))
                if j == len(x.drafts) or emitted[-1] != x.drafts[j]:
                    break
            first[x.req.request_id], more[x.req.request_id] = emitted[0], emitted[1:]
        s.update(out, first, more=more)
        trims += sum(len(r.blocks) < held[rid] for rid, r in s.requests.items() if rid in held)
        rec = s.take_record()
        ended = [r.request_id for r in rec.finished]
    assert not s.has_work
    assert trims > 5, "rejected drafts freed lookahead blocks"


def test_the_flag_is_refused_at_start_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    from scheduler_svc.__main__ import parse_args

    base = ["--redis-url", "redis://localhost:6379/0"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    assert "--speculative-config: num_speculative_tokens" in capsys.readouterr().err
    args = parse_args([*base, "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}'])
    assert spec.parse(args.speculative_config).num_speculative_tokens == 3
    assert parse_args(base).speculative_config == ""  # off by default


def test_parallel_sampling_groups_fork_and_draft() -> None:
    """``n`` completions share the prompt's blocks (copy on write of the partial one) and draft each on
    its own: outputs as without drafts, every block's references its holders', through preemption."""

    def groups() -> list[Request]:
        prompt = [10, 11, 12, 13, 14] * 3
        return [
            Request(f"g{g}#{i}", list(prompt), Params(max_tokens=25), arrival=3 * g + i, group=f"g{g}", index=i)
            for g in range(2)
            for i in range(3)
        ]

    plain = run(make(cfg=None, blocks=24), groups(), cyclic)
    for cfg in (NGRAM, SUFFIX):
        s = make(cfg=cfg, blocks=24)
        reqs = groups()
        for r in reqs:
            s.add(r)
        while s.has_work:
            step(s, cyclic)
        assert {r.request_id: r.output_ids for r in reqs} == plain
        assert s.counters.forked_tokens > 0 and s.counters.spec_accepted_tokens > 0
        assert s.counters.preemptions_recompute > 0
        assert s.blocks.num_free() == s.blocks.total()
