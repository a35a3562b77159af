"""Speculative decoding on the real stack (tiny random Llama, one executor with a small pool): greedy
output with drafts is token-identical to transformers for both proposers, under preemption (recompute and
swap), prefix caching and ``n`` (a group of three greedy completions); seeded sampled requests give the
same tokens with speculation on and off; and the sampled distribution over a two-token vocabulary
(``allowed_token_ids``) matches the model's. Last, SmolLM2 with both proposers equals transformers (a
deployment of its own).

One tiny deployment: the executor stays, the scheduler in front of it is replaced (ngram, suffix, ngram with
swap preemption, then speculation off) between tests, which run in order; each counts the drafts it accepted
(Redis' namespace counters), so no test can pass with speculation silently off. Faults mid-speculation:
tests/test_spec_faults.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import torch

from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import Service
from pagedserve.keys import Keys
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests.conftest import make_cluster
from tests.helpers import counters, greedy, offset_tokens, run_all, run_groups, wait_all_free
from tests.test_e2e_oracle import _hf_model, hf_greedy

NS = "spec"
# adaptive_draft_length false: every step that may draft asks for k max, so what these tests check (drafts
# verified exactly, rolled back, forked, preempted) happens in every run. The adaptive policy gates drafting on the
# acceptance, the coverage and the step cost it measures, which move with how a run's steps fell on two busy cores:
# a clean-clone run of the suffix test drafted nothing. The policy's own tests are the unit tests and the benchmark's.
FIXED_K = {"adaptive_draft_length": False}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **FIXED_K}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 12, **FIXED_K}
# A pool of 12 blocks of 16 tokens for 8 requests of 36-57 prompt tokens and 17-40 new ones (5-7 blocks each at full
# length, the group of three completions 8): the first step's 96 tokens already take two prompts and a chunk of a
# third, which together outgrow the pool, so some are preempted unless the requests arrive steps apart (2 and 8
# preemptions in two runs beside two busy processes). With 20 blocks, a clean-clone run whose requests finished as
# fast as the others grew preempted none.
BLOCKS = 12
# The pipelined loop (the default); preempted requests recompute unless a test asks for swap (the default, auto,
# swaps first and recomputes as the costs say: a test of drafts under recompute must not depend on that).
SCHED = ["--max-num-batched-tokens", "96", "--preemption-mode", "recompute"]


class Stack:
    """The module's deployment, and the scheduler currently in front of its executor."""

    def __init__(self, cluster: Cluster, redis_url: str) -> None:
        self.cluster = cluster
        self.sched: Service = cluster.scheduler
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)

    @property
    def address(self) -> str:
        return self.sched.address

    def use(self, spec: dict | None, *extra: str) -> None:
        """Replace the scheduler (its loop hands the executor's lease back as it stops)."""
        self.sched.stop()
        args = [*SCHED, *extra, *(["--speculative-config", json.dumps(spec)] if spec else [])]
        self.sched = self.cluster.start_scheduler(args)

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.redis.hgetall(Keys(NS).counters).items()}


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    args = [*SCHED, "--speculative-config", json.dumps(NGRAM)]
    with make_cluster(
        tiny_llama, redis_url, NS, tmp_path_factory.mktemp("logs"), blocks=BLOCKS, scheduler_args=args
    ) as c:
        yield Stack(c, redis_url)


def repeating_prompts(seed: int, n: int = 8) -> list[list[int]]:
    """Prompts that repeat themselves: one token 16 times (a whole block, shared by all: prefix-cache
    hits), then a token of their own 20 times or more. The tiny random model's greedy output then
    falls into loops of its own, which n-gram and suffix drafts predict well (a random model does not
    copy a prompt otherwise)."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 49152)] * 16
    return [head + [rng.randrange(3, 49152)] * (20 + 3 * i) for i in range(n)]


MAX_TOKENS = [40, 24, 33, 40, 17, 28, 40, 36]


def check_greedy(stack: Stack, tiny_llama: Path, seed: int, completions: int = 3) -> dict[str, int]:
    """The 8 prompts at once, the second with ``n`` = ``completions`` (greedy completions forked from one prompt,
    drafting on copy-on-write blocks): every completion is transformers' greedy output, no block leaks."""
    prompts = repeating_prompts(seed)
    expected = hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    before = stack.counters()
    reqs = [greedy(p, n) for p, n in zip(prompts, MAX_TOKENS)]
    reqs[1].sampling.n = completions
    groups = run_groups(stack.address, reqs)
    free, totals = wait_all_free(stack.redis, NS)
    assert [len(g) for g in groups] == [1, completions, 1, 1, 1, 1, 1, 1]
    for group, exp, prompt in zip(groups, expected, prompts):
        for index, msgs in group.items():
            assert offset_tokens(msgs) == exp, f"prompt of {len(prompt)} tokens diverged (completion {index})"
    assert free == totals, "blocks leaked"
    after = stack.counters()
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    if completions > 1:
        assert delta.get("forked_tokens", 0) > 0, "the group's mates took its prompt's KV from their source"
    return delta


def test_greedy_with_ngram_drafts_matches_transformers(stack: Stack, tiny_llama: Path) -> None:
    delta = check_greedy(stack, tiny_llama, 1)
    assert delta.get("spec_accepted_tokens", 0) > 0, sorted(delta.items())
    assert delta.get("spec_draft_tokens", 0) > delta["spec_accepted_tokens"], "some drafts must be rejected too"
    assert delta.get("preemptions_recompute", 0) > 0, "the small pool must preempt"
    assert delta.get("prefix_cache_hits", 0) > 0, "the shared head must hit the prefix cache"


def sampled(prompts: list[list[int]], seeds: list[int], max_tokens: int = 24, **kw: object) -> list[pb.GenerateRequest]:
    return [
        pb.GenerateRequest(
            prompt_token_ids=p,
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.4, top_k=3, seed=s, **kw),  # type: ignore[arg-type]
        )
        for p, s in zip(prompts, seeds)
    ]


SEEDED: dict[str, list[list[int]]] = {}
LOGPROBS: dict[str, list[list[tuple[int, float, int]]]] = {}
STRUCTURED: dict[str, list[list[int]]] = {}


async def _with_logprobs(address: str, reqs: list[pb.GenerateRequest]) -> list[list[tuple[int, float, int]]]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)

        async def one(req: pb.GenerateRequest) -> list[tuple[int, float, int]]:
            return [(lp.token_id, lp.logprob, lp.rank) async for resp in stub.Generate(req) for lp in resp.logprobs]

        return list(await asyncio.gather(*(one(r) for r in reqs)))


def run_seeded(stack: Stack, name: str) -> None:
    """Seeded requests (some penalized), and greedy ones with logprobs (each token's, drafted or not)."""
    prompts = repeating_prompts(7, 6)
    reqs = sampled(prompts, [11, 12, 13, 14, 15, 16]) + sampled(
        prompts[:2], [21, 22], repetition_penalty=1.2, presence_penalty=0.3
    )
    SEEDED[name] = [r.token_ids for r in run_all(stack.address, reqs)]
    LOGPROBS[name] = asyncio.run(_with_logprobs(stack.address, [greedy(p, 20, logprobs=2) for p in prompts[:3]]))
    assert all(len(x) == 20 for x in LOGPROBS[name])
    # Structured output: the grammar's matcher advances through drafts and is rolled back. (prompts[1]'s
    # constrained greedy output meets a near tie, a logit margin of 2e-4, at its 25th token: there a
    # drafted position's logits, from a forward over several query tokens, may differ in the last bits
    # from a one-token step's and pick the other token, as in any speculative decoding. Not compared.)
    regex = pb.StructuredOutput(regex="[0-9]{2}(,[0-9]{2}){3,}")
    reqs = [greedy(prompts[0], 30, structured_output=regex)]
    results = run_all(stack.address, reqs + sampled(prompts[2:4], [31, 32], 30, structured_output=regex))
    STRUCTURED[name] = [r.token_ids for r in results]
    for r in results:
        assert re.fullmatch(r"[0-9]{2}(,[0-9]{2})*,?[0-9]?", r.text), r.text
    wait_all_free(stack.redis, NS)


def test_seeded_with_ngram_drafts(stack: Stack) -> None:
    before = stack.counters().get("spec_draft_tokens", 0)
    run_seeded(stack, "ngram")
    assert stack.counters().get("spec_draft_tokens", 0) > before


def test_the_sampled_distribution_matches_the_model(stack: Stack, tiny_llama: Path) -> None:
    """Three tokens from two allowed ones, 600 seeds, with n-gram drafts (the prompt repeats the two
    tokens, so drafts are always among them and often accepted): the frequency of each of the 8
    sequences against the model's probability (transformers, masked to the two tokens, temperature 1),
    within 0.12 in total variation (the expected deviation at 600 samples is about 0.05; the unit test
    ``test_the_sampled_distribution_is_unchanged`` holds a tighter bound without a model)."""
    a, b = 1000, 2000
    prompt = [a, b, b, a, b, a, a, b] * 3 + [a, b]
    n = 600
    reqs = [
        pb.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=3, temperature=1.0, seed=1000 + i, allowed_token_ids=[a, b]),
        )
        for i in range(n)
    ]
    before = stack.counters()
    results = run_all(stack.address, reqs)
    after = stack.counters()
    assert after.get("spec_accepted_tokens", 0) > before.get("spec_accepted_tokens", 0)
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    model = _hf_model(tiny_llama)
    probs: dict[tuple[int, ...], float] = {}
    with torch.inference_mode():
        for seq in itertools.product((a, b), repeat=3):
            p = 1.0
            for i, t in enumerate(seq):
                logits = model(torch.tensor([prompt + list(seq[:i])])).logits[0, -1]
                pair = torch.softmax(logits[[a, b]].float(), -1)
                p *= float(pair[0 if t == a else 1])
            probs[seq] = p
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - p) for s, p in probs.items())
    assert tv < 0.12, (tv, counts, probs)
    wait_all_free(stack.redis, NS)


def test_greedy_with_suffix_drafts_matches_transformers(stack: Stack, tiny_llama: Path) -> None:
    stack.use(SUFFIX)
    delta = check_greedy(stack, tiny_llama, 2)
    assert delta.get("spec_accepted_tokens", 0) > 0, sorted(delta.items())
    assert delta.get("preemptions_recompute", 0) > 0


def test_seeded_with_suffix_drafts(stack: Stack) -> None:
    before = stack.counters().get("spec_draft_tokens", 0)
    run_seeded(stack, "suffix")
    assert stack.counters().get("spec_draft_tokens", 0) > before


def test_greedy_with_drafts_under_swap_preemption_matches_transformers(stack: Stack, tiny_llama: Path) -> None:
    """``--preemption-mode swap``: requests preempted while they draft go to the CPU tier and come back
    (lookahead blocks of rejected drafts were freed before; only accepted tokens' blocks move)."""
    stack.use(NGRAM, "--preemption-mode", "swap")
    delta = check_greedy(stack, tiny_llama, 3, completions=1)  # a group preempted is recomputed (its blocks are shared)
    assert delta.get("spec_accepted_tokens", 0) > 0, sorted(delta.items())
    assert delta.get("preemptions_swap", 0) > 0 and delta.get("preemptions_recompute", 0) == 0
    assert delta.get("swapped_in_blocks", 0) > 0, "swapped requests came back and went on drafting"


def test_seeded_requests_give_the_same_tokens_without_speculation(stack: Stack) -> None:
    if set(SEEDED) != {"ngram", "suffix"}:
        pytest.skip("runs after the tests that sample with drafts")
    stack.use(None)
    before = stack.counters().get("spec_draft_tokens", 0)
    run_seeded(stack, "off")
    assert stack.counters().get("spec_draft_tokens", 0) == before, "speculation is off here"
    assert SEEDED["ngram"] == SEEDED["off"]
    assert SEEDED["suffix"] == SEEDED["off"]
    assert STRUCTURED["ngram"] == STRUCTURED["off"]
    assert STRUCTURED["suffix"] == STRUCTURED["off"]
    for name in ("ngram", "suffix"):
        for on, off in zip(LOGPROBS[name], LOGPROBS["off"]):
            assert [(t, r) for t, _, r in on] == [(t, r) for t, _, r in off]
            assert [lp for _, lp, _ in on] == pytest.approx([lp for _, lp, _ in off], abs=1e-4)


# SmolLM2 asked to hand back what it was given (the benchmark's kind of request, short): its greedy answers quote.
QUOTING = [
    "Rewrite this sentence, keeping every word: The quick brown fox jumps over the lazy dog while the old farmer "
    "sleeps in the shade of the barn.",
    "Add type hints to this function and reply with the whole function:\n\ndef area(width, height):\n"
    "    if width < 0 or height < 0:\n        raise ValueError('negative size')\n    return width * height\n",
    "Correct the spelling and reply with the corrected text in full: The comittee recieved the report on "
    "wensday and decided to adress the isues at the next meating.",
    "Rename the variable x to total in this code and reply with the code:\n\nx = 0\nfor item in items:\n"
    "    x += item.price * item.quantity\nprint(x)\n",
    "Summarise: A KV cache stores the keys and values of every token a model has seen, so that each new token "
    "attends to them without computing them again. PagedAttention stores them in fixed-size blocks.",
    "Repeat the list in reverse order: apple, banana, cherry, date, elderberry, fig, grape.",
]
SMOL_MAX_TOKENS = 48


def test_smollm2_greedy_with_drafts_matches_transformers(smol_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """SmolLM2 with each proposer, six concurrent chat requests (the first with ``n`` = 2) on a pool too small
    for all of them (preempted, and rejected drafts' blocks taken by others): transformers' tokens in every
    completion, drafts accepted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    prompts = [
        tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False))[
            "input_ids"
        ]
        for q in QUOTING
    ]
    expected = hf_greedy(smol_dir, prompts, [SMOL_MAX_TOKENS] * len(prompts))
    ns = "spec-smol"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    reqs = [greedy(p, SMOL_MAX_TOKENS) for p in prompts]
    reqs[0].sampling.n = 2  # a group: two greedy completions drafting on forked blocks
    args = ["--speculative-config", json.dumps(NGRAM)]
    with make_cluster(smol_dir, redis_url, ns, tmp_path, blocks=24, scheduler_args=args) as cluster:
        for cfg in (NGRAM, SUFFIX):
            if cfg is SUFFIX:  # the next scheduler (its loop hands the executor's lease back as it stops)
                cluster.schedulers.pop(0).stop()
                cluster.start_scheduler(["--speculative-config", json.dumps(cfg)])
            before = counters(client, ns)
            groups = run_groups(cluster.address, reqs)
            free, totals = wait_all_free(client, ns)
            after = counters(client, ns)
            assert [len(g) for g in groups] == [2] + [1] * (len(reqs) - 1)
            got = [[offset_tokens(msgs) for _, msgs in sorted(g.items())] for g in groups]
            assert got == [[e] * len(g) for e, g in zip(expected, groups)], cfg["method"]
            assert after.get("spec_accepted_tokens", 0) > before.get("spec_accepted_tokens", 0), cfg["method"]
            assert free == totals
    preempted = after.get("preemptions_recompute", 0) + after.get("preemptions_swap", 0)
    assert preempted > 0, "the small pool preempted"
