"""Sampling parity on real deployments (tiny Llama, real Redis, real gRPC): logprobs and
prompt logprobs equal transformers' log_softmax, Resume returns the same logprobs from any
offset, seeded sampling with every option is reproducible and survives preemption (recompute
and swap), and bad values are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

from pagedserve.dev.launch import Cluster
from pagedserve.rpc import CHANNEL_OPTIONS
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from tests import helpers
from tests.conftest import make_cluster

rng = random.Random(7)
PROMPTS = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 40, 17)]
ATOL = 1e-4


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A 16-token step budget: the longer prompts are prefilled in chunks, so prompt logprobs
    cross chunk boundaries."""
    with make_cluster(
        tiny_llama,
        redis_url,
        "sampling",
        tmp_path_factory.mktemp("logs"),
        blocks=64,
        scheduler_args=["--max-num-batched-tokens", "16"],
    ) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


async def _stream(address: str, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        return [r async for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=300)]


async def _resume(address: str, rid: str, offset: int) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        return [
            r
            async for r in pb_grpc.GenerationStub(ch).Resume(
                pb.ResumeRequest(request_id=rid, offset=offset), timeout=300
            )
        ]


def _gather(address: str, reqs: list[pb.GenerateRequest]) -> list[list[pb.GenerateResponse]]:
    async def go() -> list[list[pb.GenerateResponse]]:
        return await asyncio.gather(*(_stream(address, r) for r in reqs))

    return asyncio.run(go())


def _flat(responses: list[pb.GenerateResponse]) -> tuple[list[int], list[pb.TokenLogprobs]]:
    ids = [t for r in responses for t in r.token_ids]
    lps = [e for r in responses for e in r.logprobs]
    return ids, lps


def _check(entry: pb.TokenLogprobs, row: torch.Tensor, token: int, k: int) -> None:
    """``entry`` against ``row``, transformers' log_softmax at the position before ``token``."""
    assert entry.token_id == token
    assert abs(entry.logprob - row[token].item()) < ATOL
    # Rank: 1 + the tokens above this one. Logits within ATOL of it may fall on either side (another summation
    # order), in both directions: a tiny random model's row holds thousands of near-ties.
    above, near = int((row > row[token] + ATOL).sum()), int((row > row[token] - ATOL).sum()) - 1
    assert 1 + above <= entry.rank <= 1 + near
    assert len(entry.top_token_ids) == k
    want = row.topk(k).values
    assert torch.allclose(torch.tensor(list(entry.top_logprobs)), want, atol=ATOL), "the k largest, in order"
    assert torch.allclose(row[list(entry.top_token_ids)], want, atol=ATOL), "each id's own logprob"


def test_logprobs_equal_transformers_log_softmax(cluster: Cluster, hf: AutoModelForCausalLM) -> None:
    ks = [5, 0, 20, 3]
    reqs = [helpers.greedy(p, 12, ignore_eos=True, logprobs=k, prompt_logprobs=k) for p, k in zip(PROMPTS, ks)]
    results = _gather(cluster.address, reqs)
    for prompt, k, responses in zip(PROMPTS, ks, results):
        ids, lps = _flat(responses)
        assert len(ids) == 12 and len(lps) == 12
        firsts = [r for r in responses if r.token_ids]
        assert len(firsts[0].prompt_logprobs) == len(prompt) - 1, "every prompt token but the first"
        assert all(not r.prompt_logprobs for r in responses if r is not firsts[0])
        with torch.inference_mode():
            rows = torch.log_softmax(hf(torch.tensor([prompt + ids])).logits[0].float(), dim=-1)
        for i, e in enumerate(lps):
            _check(e, rows[len(prompt) - 1 + i], ids[i], k)
            assert e.token_id == int(rows[len(prompt) - 1 + i].argmax()), "greedy took the most likely"
        for i, e in enumerate(firsts[0].prompt_logprobs):
            _check(e, rows[i], prompt[i + 1], k)


def test_resume_returns_the_same_logprobs(cluster: Cluster) -> None:
    req = helpers.greedy(PROMPTS[2], 10, ignore_eos=True, logprobs=4, prompt_logprobs=2)
    (streamed,) = _gather(cluster.address, [req])
    rid = streamed[0].request_id
    ids, lps = _flat(streamed)
    prompt_lps = [e for r in streamed for e in r.prompt_logprobs]
    for offset in (0, 1, 6, 10):
        resumed = asyncio.run(_resume(cluster.address, rid, offset))
        r_ids, r_lps = _flat(resumed)
        assert r_ids == ids[offset:] and r_lps == lps[offset:], offset
        r_prompt = [e for r in resumed for e in r.prompt_logprobs]
        assert r_prompt == (prompt_lps if offset == 0 else []), offset


EVERY_OPTION = dict(
    temperature=0.9,
    top_k=30,
    top_p=0.95,
    min_p=0.01,
    presence_penalty=0.7,
    frequency_penalty=0.4,
    repetition_penalty=1.3,
    min_tokens=20,
    logprobs=3,
    logit_bias={17: 3.0, 99: -100.0, 2: 8.0},
)


def _every_option(i: int, prompt: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=24 + 3 * i, seed=500 + i, stop_token_ids=[2], **EVERY_OPTION),
    )


# Each mode: the scheduler's flags and the CPU swap tier in blocks (None: the executor's default).
PREEMPT = {
    "recompute": (["--preemption-mode", "recompute"], None),
    "swap": (["--preemption-mode", "swap"], 64),
}


@pytest.mark.parametrize("mode", list(PREEMPT))
def test_seeded_sampling_with_every_option_survives_preemption(
    mode: str, tiny_llama: Path, redis_url: str, tmp_path: Path
) -> None:
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(20, 50))] for _ in range(10)]
    reqs = [_every_option(i, p) for i, p in enumerate(prompts)]
    sargs, swap_blocks = PREEMPT[mode]
    ns = f"sampling-{mode}"
    with make_cluster(
        tiny_llama,
        redis_url,
        ns,
        tmp_path,
        blocks=12,
        swap_blocks=swap_blocks,
        scheduler_args=[*sargs, "--max-num-batched-tokens", "48"],
    ) as c:
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        alone = [_gather(c.address, [r])[0] for r in reqs[:4]]
        again = _gather(c.address, [reqs[0]])[0]
        assert sum(helpers.counters(client, ns).get(f"preemptions_{m}", 0) for m in PREEMPT) == 0
        together = _gather(c.address, reqs)
        assert helpers.counters(client, ns)[f"preemptions_{mode}"] > 0
    assert _flat(again) == _flat(alone[0]), "the same seed, the same tokens and logprobs"
    for i, (a, t) in enumerate(zip(alone, together)):
        a_ids, a_lps = _flat(a)
        t_ids, t_lps = _flat(t)
        assert t_ids == a_ids, f"request {i} changed under {mode} preemption"
        assert len(a_ids) >= EVERY_OPTION["min_tokens"], "min_tokens held the stop token back"
        assert 99 not in a_ids
        assert [e.token_id for e in t_lps] == t_ids
        assert all(abs(x.logprob - y.logprob) < ATOL for x, y in zip(a_lps, t_lps))


BAD = [
    ("min_p", dict(min_p=1.5)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-3.0)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("min_tokens", dict(min_tokens=20, max_tokens=10)),
    ("logit_bias", dict(logit_bias={49152: 1.0})),
    ("logit_bias", dict(logit_bias={3: 101.0})),
    ("logit_bias", dict(logit_bias={3: float("nan")})),
    ("logprobs", dict(logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=1000)),
]


@pytest.mark.parametrize(("field", "sampling"), BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_values_are_invalid_argument_naming_the_field(cluster: Cluster, field: str, sampling: dict) -> None:
    req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(**sampling))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _gather(cluster.address, [req])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in (err.value.details() or "")
