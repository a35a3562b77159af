"""The correctness oracle: greedy output served over gRPC is token-identical
to Hugging Face ``generate(do_sample=False)``, for concurrent prompts of mixed
lengths that cross block boundaries, on SmolLM2 and two tiny architectures."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import redis
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import make_cluster
from tests.helpers import greedy, run_all, wait_all_free

# Prompt lengths around multiples of the 16-token block; outputs cross boundaries too.
LENGTHS = [3, 15, 16, 17, 31, 33, 48, 70]
MAX_TOKENS = [20, 9, 17, 16, 24, 12, 30, 18]

TEXTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind that blows over it at night.",
    'def fibonacci(n):\n    """Return the nth Fibonacci number."""\n',
    "Explain why the sky is blue to a five year old child, using simple words and a friendly tone.",
    "List three benefits of regular exercise:",
    "Once upon a time, in a land far, far away, there lived a dragon who loved to read books. Every",
    "Translate into French: 'The cat sleeps on the warm windowsill while the rain falls outside.'",
    "Q: What is 12 times 12?\nA:",
]


@functools.cache
def _hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# (model dir, prompt) -> the longest greedy output generated so far for it, in this session. Greedy decoding of one
# prompt (batch 1) runs the same computations whatever max_new_tokens is, so a shorter output is a prefix of a
# longer one, and an output that stopped before its max_new_tokens stopped at EOS: it is the whole answer.
_GREEDY: dict[tuple[Path, tuple[int, ...]], tuple[list[int], int]] = {}


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' ``generate(do_sample=False)`` per prompt, one at a time; outputs cached for the session."""
    outs = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_tokens):
            key = (Path(model_dir), tuple(ids))
            tokens, asked = _GREEDY.get(key, ([], 0))
            if asked < n and len(tokens) == asked:  # not generated this far, and not stopped at EOS
                gen = _hf_model(Path(model_dir)).generate(
                    torch.tensor([ids]),
                    max_new_tokens=n,
                    do_sample=False,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                )
                tokens, asked = gen[0, len(ids) :].tolist(), n
                _GREEDY[key] = tokens, asked
            outs.append(tokens[:n])
    return outs


def random_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]


def text_prompts(model_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t).input_ids for t in TEXTS]
    # Pad or trim to the target lengths with real text so lengths straddle block edges.
    filler = tok(" and then the story went on and on, as stories do," * 8).input_ids
    return [(p + filler)[:n] if len(p) < n else p[:n] for p, n in zip(prompts, LENGTHS)]


@pytest.mark.parametrize("arch", ["smollm2", "tiny-llama", "tiny-qwen2"])
def test_greedy_matches_transformers(arch: str, request: pytest.FixtureRequest, redis_url: str, tmp_path: Path) -> None:
    model_dir = request.getfixturevalue(
        {"smollm2": "smol_dir", "tiny-llama": "tiny_llama", "tiny-qwen2": "tiny_qwen2"}[arch]
    )
    prompts = text_prompts(model_dir) if arch == "smollm2" else random_prompts(len(arch))
    assert sorted(len(p) for p in prompts) == sorted(LENGTHS)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    ns = f"oracle-{arch}"
    with make_cluster(
        model_dir,
        redis_url,
        ns,
        tmp_path,
        kv_cache_memory=64 << 20 if arch == "smollm2" else 1 << 20,
        scheduler_args=["--max-num-batched-tokens", "64"],
    ) as cluster:
        results = run_all(cluster.address, [greedy(p, n) for p, n in zip(prompts, MAX_TOKENS)])
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        free, totals = wait_all_free(client, ns)
    for res, exp, prompt in zip(results, expected, prompts):
        assert res.token_ids == exp, f"prompt of {len(prompt)} tokens diverged"
        assert res.prompt_tokens == len(prompt)
        assert res.completion_tokens == len(exp)
        assert res.finish_reason in ("stop", "length")
    assert free == totals, "blocks leaked after every request finished"
