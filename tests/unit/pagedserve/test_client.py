"""The resuming client's bookkeeping (``pagedserve.client.Progress``) on plain messages: an offset per
completion, the end when every completion has ended, one Resume per unfinished completion."""

from __future__ import annotations

import pytest

from pagedserve.client import Progress
from pagedserve.v1 import generation_pb2 as pb


def msg(index: int, offset: int, tokens: list[int], finish: str = "") -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="g", index=index, offset=offset, token_ids=tokens, finish_reason=finish)


def test_interleaved_completions_keep_their_own_offsets_and_end_together() -> None:
    got = Progress(n=2)
    assert got.take(msg(0, 0, [1, 2])) is not None
    late = got.take(msg(1, 0, [7]))  # completion 1 is behind completion 0: nothing of it is dropped
    assert late is not None and list(late.token_ids) == [7]
    assert got.take(msg(0, 2, [3], "length")) is not None
    assert not got.finished, "completion 1 has not ended"
    assert got.take(msg(0, 3, [], "length")) is None, "a completion that ended says nothing more"
    again = got.take(msg(1, 0, [7, 8]))  # a replay overlapping what the caller has
    assert again is not None and (again.offset, list(again.token_ids)) == (1, [8])
    assert got.take(msg(1, 2, [], "stop")) is not None
    assert got.finished and got.have == [3, 2]


def test_resumes_ask_each_unfinished_completion_from_its_own_offset() -> None:
    got = Progress(n=3)
    got.take(msg(0, 0, [1, 2, 3], "stop"))
    got.take(msg(2, 0, [5]))
    asks = [got.resume("g", i) for i in got.unfinished()]
    assert [(r.index, r.offset) for r in asks] == [(1, 0), (2, 1)]
    assert all(r.HasField("index") and r.request_id == "g" for r in asks)
    single = Progress()
    single.take(msg(0, 0, [4, 4]))
    (only,) = [single.resume("r", i) for i in single.unfinished()]
    assert only.offset == 2 and not only.HasField("index"), "without n, a plain Resume as before"


def test_a_gap_is_an_error_not_a_silent_loss() -> None:
    got = Progress(n=2)
    got.take(msg(1, 0, [1]))
    with pytest.raises(RuntimeError, match=r"skipped tokens 1\.\.3"):
        got.take(msg(1, 3, [9]))
