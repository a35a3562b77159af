"""``benchmarks.stack.read_log``: a live deployment's step log, read while the loop may still be appending a line."""

from __future__ import annotations

from pathlib import Path

from benchmarks.stack import read_log


def test_a_line_still_being_written_is_left_out(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    assert read_log(log) == []
    log.write_text('{"t": 1}\n{"t": 2}\n')
    assert read_log(log) == [{"t": 1}, {"t": 2}]
    with log.open("a") as f:
        f.write('{"t": 3, "executor": "ab')  # the writer's line, cut where a concurrent read can see it
    assert read_log(log) == [{"t": 1}, {"t": 2}]
    with log.open("a") as f:
        f.write('c"}\n')
    assert read_log(log) == [{"t": 1}, {"t": 2}, {"t": 3, "executor": "abc"}]
