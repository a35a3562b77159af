"""Many LoRA adapters on the default model, SmolLM2 (30 layers, tied embeddings), end to end: three
adapters and the base model mixed in steps, through recompute preemptions and prefix-cache hits,
each adapter's greedy output token-identical to transformers + PEFT's (``tests/lora_support.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from pagedserve.dev.launch import Cluster
from tests import helpers
from tests.conftest import make_cluster
from tests.helpers import run_all
from tests.lora_support import ALL, PROMPTS, make_adapters, mixes_all, on, peft_greedy_each, steps_since
from tests.test_e2e_oracle import hf_greedy

SMOL = "lora-smol"
SMOL_TOKENS = 24
# Twelve requests of 3 blocks (prompt) growing to 4-5, on 32 blocks: about ten start at once, so they mix every
# adapter and the base model (ten of the twelve hold some of each kind), then outgrow the pool; the newest are
# preempted and recomputed, hitting the prefix cache (each adapter's two shared blocks and their own).
SMOL_BLOCKS = 32


@dataclass(frozen=True, slots=True)
class Smol:
    cluster: Cluster
    steps: Path  # its scheduler's step log
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def smol(smol_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Smol]:
    """SmolLM2 with three adapters from --lora-modules (two of rank 8 on every target, one of rank 4 on
    three), on a pool small enough to preempt."""
    root = tmp_path_factory.mktemp("smol")
    paths = make_adapters(
        smol_dir, root, {"s0": (10, 8, ALL), "s1": (11, 8, ALL), "s2": (12, 4, ["q_proj", "v_proj", "down_proj"])}
    )
    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
    steps = root / "steps.jsonl"
    with make_cluster(
        smol_dir,
        redis_url,
        SMOL,
        root / "logs",
        blocks=SMOL_BLOCKS,
        executor_args=lora,
        scheduler_args=[
            *lora,
            *("--preemption-mode", "recompute"),  # preempted requests come back through the prefix cache
            *("--lora-modules", *(f"{n}={p}" for n, p in paths.items())),
            *("--step-log", str(steps)),
        ],
    ) as cluster:
        yield Smol(cluster, steps, paths)


def test_smollm2_three_adapters_and_the_base_model_in_one_batch_match_peft_under_preemption(
    smol: Smol, smol_dir: Path
) -> None:
    """The default model (30 layers, tied embeddings) end to end: each adapter's greedy output is
    transformers + PEFT's, in steps that mix three adapters and the base model, through recompute
    preemptions and prefix-cache hits."""
    r = redis.Redis.from_url(smol.cluster.redis_url, decode_responses=True)
    names = ["s0", "s1", "s2", ""]
    before = helpers.counters(r, SMOL)
    results = run_all(smol.cluster.address, [on(name, ids, SMOL_TOKENS) for ids in PROMPTS for name in names])
    after = helpers.counters(r, SMOL)
    want = peft_greedy_each(smol_dir, smol.adapters, PROMPTS, SMOL_TOKENS)
    want[""] = hf_greedy(smol_dir, PROMPTS, [SMOL_TOKENS] * len(PROMPTS))
    for i in range(len(PROMPTS)):
        for j, name in enumerate(names):
            assert results[i * len(names) + j].token_ids == want[name][i], f"adapter {name or 'base'!r}, prompt {i}"
    assert len({tuple(want[n][0]) for n in names}) == 4, "the adapters change the output (else this tests nothing)"
    assert after.get("preemptions_recompute", 0) > before.get("preemptions_recompute", 0), "the small pool preempted"
    assert after.get("prefix_cache_hits", 0) > before.get("prefix_cache_hits", 0), "the shared prefix hit"
    assert mixes_all(steps_since([smol.steps], 0), 3), "some step ran all three adapters and the base model"
