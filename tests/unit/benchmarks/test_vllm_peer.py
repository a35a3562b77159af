"""The vllm arm's schedule of runs, on plain data."""

from __future__ import annotations

from benchmarks.vllm_peer import windows


def test_rounds_alternate_with_one_server_up_at_a_time() -> None:
    assert windows(1) == [(0, [0]), (1, [0])]
    assert windows(2) == [(0, [0]), (1, [0, 1]), (0, [1])], "A B B A: vLLM starts once"
    for n in range(1, 6):
        turns = windows(n)
        assert all(a[0] != b[0] for a, b in zip(turns, turns[1:])), "a server's consecutive runs share one start"
        runs = [(d, i) for d, rounds in turns for i in rounds]
        assert sorted(runs) == sorted((d, i) for i in range(n) for d in (0, 1)), "each server runs each round once"
        firsts = [next(d for d, i in runs if i == r) for r in range(n)]
        assert firsts == [r % 2 for r in range(n)], "the server that runs first alternates"
