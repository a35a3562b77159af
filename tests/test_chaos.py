"""Every fault at once, under load (``tests/chaos.py``): one round of the seeded schedule on a real stack, and the
schedule itself. ``make chaos`` runs the long form."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from tests.chaos import KINDS, chaos, schedule

SEED = int(os.environ.get("PAGEDSERVE_CHAOS_SEED", "27"))


def test_each_round_has_every_fault_once_and_a_seed_gives_one_schedule() -> None:
    rounds = list(itertools.islice(schedule(5), 4))
    assert all(sorted(f.kind for f in r) == sorted(KINDS) for r in rounds)
    assert rounds == list(itertools.islice(schedule(5), 4))
    assert rounds != list(itertools.islice(schedule(6), 4))


@pytest.mark.deployments(20)  # 3 executors, 2 replicas, Redis, a join, restarts: one of the longest, so it goes first
def test_every_fault_at_once_under_load_loses_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    """One round: every kind of fault once while six clients stream greedy, shared-prefix, seeded, n=2 and
    structured requests through the resuming client. Set PAGEDSERVE_CHAOS_SEED to replay another schedule."""
    tally = chaos(tiny_llama, SEED, 0, tmp_path, keep=1)  # no replacements: 3, 2, 1 executors after a kill and a drain
    summary = tally.summary()
    assert summary["faults"] == dict.fromkeys(KINDS, 1)
    assert set(summary["requests_by_kind"]) == {"greedy", "prefix", "seeded", "group", "structured"}
    assert tally.clean, f"seed {SEED}: " + json.dumps(summary, indent=1)
