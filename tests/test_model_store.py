"""The model cache under concurrent first starts: two converters, one cache, both succeed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from executor_svc.model_store import DEFAULT_MODEL


def test_two_conversions_into_one_empty_cache_both_succeed(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "executor_svc.model_store", "--cache-dir", str(tmp_path)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    models = tmp_path / "models"
    for code, out, err in results:
        assert code == 0, err
        assert out.strip() == str(models / DEFAULT_MODEL)
    # Exactly one conversion's work is kept: the other waited on the lock and used it.
    assert sum("converted by another process meanwhile" in err for _, _, err in results) == 1
    assert (models / DEFAULT_MODEL / "config.json").exists()
    assert [p.name for p in models.iterdir() if p.name.startswith(".convert-")] == []
