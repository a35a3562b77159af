"""Shared fixtures: a real redis-server, real model directories, real deployments.

Tiny randomly initialised models (Llama, Qwen2 configs) keep the suite fast;
they carry SmolLM2's real tokenizer so that text paths are exercised too.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

# One torch (OpenMP) thread per process, inherited by every executor the suite starts: make test runs two workers on
# 2 cores, each with a model in its own process and in its deployments' executors, and tiny models gain nothing from
# a second thread; more threads per process only spin against each other for the cores. An explicit value wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Deployments' services fork from a server that imported their code once per worker (pagedserve/dev/warm.py): an
# executor's start costs ~2 s instead of ~10 (torch and transformers imported again each time), and the suite starts
# about seventy. Each service is still its own process, signalled, killed and reaped as one. An explicit value wins.
os.environ.setdefault("PAGEDSERVE_WARM_STARTS", "1")

import torch  # noqa: E402

from executor_svc.model_store import resolve_model
from pagedserve.dev.launch import Cluster
from pagedserve.dev.procs import RedisServer
from tests.helpers import GIB, block_bytes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# The order of modules for ``make test`` (``pytest -n 2 --dist loadscope``): its two workers take whole modules in
# collection order, one at a time, so the longest must start first and the short ones (unit tests) end the run;
# a long module started last runs alone while the other worker idles. No list of names is kept by hand (one
# rotted as modules grew, moved and appeared); the order is computed:
# - from the last complete run on this machine: ``make test`` (the whole suite from testpaths, no -k/-m, not
#   stopped early) records each module's seconds (setup, call and teardown of its tests, module-scoped
#   deployments included) in .cache/test-durations.json, and the next run starts the longest first;
# - for a module with no record (a clean clone, as in CI, or a new module), from its fixtures: a test that takes a
#   real process or model (``REAL``: a redis-server, a model directory) itself starts its own deployment, and a
#   module- or class-scoped fixture that reaches one, or builds files (``tmp_path_factory``: a model, certificates),
#   is one setup for the whole module. Such modules run first, the most starts first (a module never measured is
#   assumed long), then the measured ones, longest first; modules that start nothing (static checks) and the
#   unit tests (tests/unit/, plain data by design) run last. Within a module the order is the file's.
DURATIONS = Path(__file__).resolve().parent.parent / ".cache" / "test-durations.json"
REAL = frozenset({"redis_url", "tiny_llama", "tiny_qwen2", "smol_dir"})
BUILDS = REAL | {"tmp_path_factory"}


def module_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def deployments(items: list[pytest.Item]) -> dict[str, int]:
    """Per module, how many deployments (or other real processes, models and files) its tests start, from fixtures."""
    own: dict[str, int] = {}
    shared: dict[str, set[str]] = {}
    for item in items:
        module = module_of(item.nodeid)
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        own[module] = own.get(module, 0) + bool(REAL & set(info.argnames))
        if (marker := item.get_closest_marker("deployments")) is not None:  # starts its own, fixtures can't show
            own[module] += int(marker.args[0]) - 1
        for name in item.fixturenames:
            defs = info.name2fixturedefs.get(name, ())
            if defs and defs[-1].scope in ("class", "module", "package") and reaches(name, info.name2fixturedefs):
                shared.setdefault(module, set()).add(name)
    return {m: own.get(m, 0) + len(shared.get(m, ())) for m in {*own, *shared}}


def reaches(name: str, defs: dict[str, Sequence[Any]], seen: frozenset[str] = frozenset()) -> bool:
    """Whether fixture ``name`` is, or depends on, one in ``BUILDS``."""
    if name in BUILDS:
        return True
    fixture = defs.get(name)
    seen = seen | {name}
    return bool(fixture) and any(reaches(arg, defs, seen) for arg in fixture[-1].argnames if arg not in seen)


def recorded() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seconds, starts = recorded(), deployments(items)

    def rank(module: str) -> tuple[int, float]:
        if module in seconds:
            return (1, -seconds[module])
        if starts.get(module) and not module.startswith("tests/unit/"):
            return (0, -starts[module])
        return (2, 0.0)

    items.sort(key=lambda item: rank(module_of(item.nodeid)))  # stable: a module keeps its order


SPENT: dict[str, float] = {}  # this run's seconds per module


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every phase's seconds, by module; xdist's controller gets its workers' reports here too."""
    SPENT[module_of(report.nodeid)] = SPENT.get(module_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Record the modules' seconds after a complete run of the suite (not on xdist's workers, not for a part)."""
    config = session.config
    whole = (
        config.args_source is pytest.Config.ArgsSource.TESTPATHS
        and not config.option.keyword
        and not config.option.markexpr
        and not config.option.deselect
        and not session.shouldstop
        and not session.shouldfail
        and not hasattr(config, "workerinput")
        and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
    )
    if whole and SPENT:
        DURATIONS.parent.mkdir(exist_ok=True)
        DURATIONS.write_text(json.dumps({m: round(s, 1) for m, s in sorted(SPENT.items())}, indent=1) + "\n")


LOG_TAIL_LINES = 30


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that ran a deployment in its ``tmp_path`` reports the tail of each service's log: CI keeps
    only the run's output, and a hang ("no progress") says nothing without what the services said."""
    report = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and isinstance(tmp, Path) and tmp.is_dir():
        for log in sorted(tmp.rglob("*.log"))[:8]:
            try:
                lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            except OSError:
                continue
            report.sections.append((f"last {len(lines)} lines of {log.name}", "\n".join(lines)))
    return report


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
    return save_model(model, dst, tokenizer_src)


def save_model(model: torch.nn.Module, dst: Path, tokenizer_src: Path) -> Path:
    """``model``'s weights and config into ``dst``, beside ``tokenizer_src``'s tokenizer files: a model directory."""
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
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    """The official ``openai`` client on the module's ``cluster`` (started with ``http_port``); its timeout only
    guards against a hang."""
    assert cluster.http_url is not None
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="EMPTY", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def tiny_cluster(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Tiny Llama (512-token context) with a small pool: 24 blocks of 16 tokens."""
    with make_cluster(tiny_llama, redis_url, "tiny", tmp_path_factory.mktemp("logs"), blocks=24) as cluster:
        yield cluster
