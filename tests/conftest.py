"""Shared fixtures: a real redis-server, real model directories, real deployments.

Tiny randomly initialised models (Llama, Qwen2 configs) keep the suite fast;
they carry SmolLM2's real tokenizer so that text paths are exercised too.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# One torch (OpenMP) thread per process, inherited by every executor the suite starts: make test runs two workers on
# 2 cores, each with a model in its own process and in its deployments' executors, and tiny models gain nothing from
# a second thread; more threads per process only spin against each other for the cores. An explicit value wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from executor_svc.model_store import resolve_model
from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import RedisServer
from tests.helpers import GIB, block_bytes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# The longest modules first (wall seconds measured with two workers, 2026-12-01). ``make test``'s xdist workers take
# whole modules (``--dist loadscope``) in collection order, so starting with the longest and ending with the short
# ones (unit tests last) keeps both workers busy to the end instead of one finishing a long module alone.
LONGEST_FIRST = (
    "tests/test_scale_out.py",
    "tests/test_streams.py",
    "tests/test_bench_smoke.py",
    "tests/test_structured_output.py",
    "tests/test_preemption.py",
    "tests/test_prefix_cache.py",
    "tests/test_e2e_oracle.py",
    "tests/test_parallel_sampling.py",
    "tests/test_failover.py",
    "tests/test_pipeline.py",
    "tests/test_redis_auth.py",
    "tests/test_gpu_check.py",
    "tests/test_sampling.py",
    "tests/test_security.py",
    "tests/test_state_property.py",
    "tests/test_prometheus.py",
    "tests/test_http.py",
    "tests/test_status.py",
    "tests/test_health.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: (rank.get(item.nodeid.split("::")[0], len(rank)), item.nodeid.startswith("tests/unit/"))
    )  # stable: a module keeps its order


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """``$REDIS_URL`` when set, else a real redis-server on a free port."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = RedisServer()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    return resolve_model(None)


def build_tiny(kind: str, dst: Path, tokenizer_src: Path) -> Path:
    """A tiny random model of architecture ``kind`` with a real tokenizer."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_attention_heads=6, num_key_value_heads=2, **common))
    else:
        raise ValueError(kind)
    model.save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).exists():
            shutil.copy(tokenizer_src / name, dst / name)
    return dst


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    return build_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), smol_dir)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    return build_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), smol_dir)


def make_cluster(
    model: Path,
    redis_url: str,
    namespace: str,
    log_dir: Path,
    *,
    blocks: int | None = None,
    swap_blocks: int | None = None,
    disk_swap_blocks: int | None = None,
    **flags: Any,
) -> Cluster:
    """The one cluster factory: a real deployment of ``model`` on ``redis_url``, isolated by key ``namespace``,
    its logs in ``log_dir``. A module's (or a test's) fixture passes only what differs.

    Sizes are counts of the model's KV blocks (``helpers.block_bytes``, read from its config.json): ``blocks`` in the
    executor's device pool (``--kv-cache-memory``), ``swap_blocks`` in the CPU swap tier (``--swap-space``) and
    ``disk_swap_blocks`` in the disk tier (``--disk-swap-space``, with a ``--swap-dir`` in ``executor_args``); unset,
    the executor's defaults apply. Every other flag goes to ``Cluster`` as it is (``kv_cache_memory`` in bytes too,
    for a pool sized in bytes)."""
    sized_in_blocks = (blocks, swap_blocks, disk_swap_blocks) != (None, None, None)
    one = block_bytes(model, flags.get("block_size", 16)) if sized_in_blocks else 0
    if blocks is not None:
        flags["kv_cache_memory"] = blocks * one
    tiers = [("--swap-space", swap_blocks), ("--disk-swap-space", disk_swap_blocks)]
    sized = [arg for flag, n in tiers if n is not None for arg in (flag, str(n * one / GIB))]
    if sized:
        flags["executor_args"] = [*(flags.get("executor_args") or []), *sized]
    return Cluster(str(model), redis_url=redis_url, namespace=namespace, log_dir=log_dir, **flags)


@pytest.fixture(scope="module")
def tiny_cluster(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Tiny Llama (512-token context) with a small pool: 24 blocks of 16 tokens."""
    with make_cluster(tiny_llama, redis_url, "tiny", tmp_path_factory.mktemp("logs"), blocks=24) as cluster:
        yield cluster
