"""A stream's repair and endings (``scheduler_svc.frontend.streams``): SmolLM2's real tokenizer and a real
``StreamQueue``; the store's two reads (a completion's tokens and logprobs by offset) are stood in
by a list, which isolates the stream's bookkeeping from Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scheduler_svc.frontend.bus import DRAIN, StreamQueue
from scheduler_svc.frontend.detok import Detokenizer
from scheduler_svc.frontend.streams import (
    Chunk,
    QueueTimeout,
    Stream,
    StreamDetached,
    follow,
)


class Completion:
    """What Redis holds of the request: its output tokens so far."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.reads: list[tuple[int, int]] = []

    async def output(self, request_id: str, start: int, end: int) -> list[int]:
        self.reads.append((start, end))
        return self.tokens[start:end]


@pytest.fixture(scope="module")
def tok(smol_dir: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(smol_dir)


def stream(tok, stop: list[str] | None = None, stopped: list[str] | None = None) -> Stream:  # noqa: ANN001
    return Stream("r1", 5, Detokenizer(tok, stop or []), 0.0, on_stop=(stopped if stopped is not None else []).append)


def run(s: Stream, store: Completion, events: list[tuple]) -> tuple[list[Chunk], BaseException | None]:
    async def go() -> tuple[list[Chunk], BaseException | None]:
        q = StreamQueue()
        for e in events:
            q.put_nowait(e)
        got: list[Chunk] = []
        try:
            async for chunk in follow(store, s, q):  # type: ignore[arg-type]
                got.append(chunk)
        except (StreamDetached, QueueTimeout) as exc:
            return got, exc
        return got, None

    return asyncio.run(go())


def test_overlap_is_dropped_and_a_gap_read_back(tok) -> None:  # noqa: ANN001
    ids = tok("The quick brown fox jumps over the lazy dog", add_special_tokens=False).input_ids
    store = Completion(ids)
    events = [
        ("t", (0, ids[:2], None)),
        ("t", (1, ids[1:4], None)),  # overlaps the first by one
        ("t", (6, ids[6:8], None)),  # skips 4..6
        ("f", ("length", len(ids), 3)),
    ]  # the finish names the total: the tail is read back
    chunks, err = run(s := stream(tok), store, events)
    assert err is None
    assert [t for c in chunks for t in c.token_ids] == ids  # each token once, in order
    assert [c.offset for c in chunks] == [0, 2, 4, 8]
    assert store.reads == [(4, 6), (8, len(ids))]
    last = chunks[-1]
    assert (last.finish_reason, last.completion_tokens, last.prompt_tokens, last.cached_tokens) == (
        "length",
        len(ids),
        5,
        3,
    )
    assert "".join(c.text for c in chunks) == tok.decode(ids) and s.done


def test_a_stop_string_ends_the_text_and_cancels_the_request_once(tok) -> None:  # noqa: ANN001
    ids = tok("one two. three four", add_special_tokens=False).input_ids
    stopped: list[str] = []
    chunks, err = run(
        stream(tok, stop=["."], stopped=stopped), Completion(ids), [("t", (i, [t], None)) for i, t in enumerate(ids)]
    )
    assert err is None and stopped == ["r1"]
    assert "".join(c.text for c in chunks) == "one two" and chunks[-1].finish_reason == "stop"


def test_a_stop_string_in_the_last_tokens_cancels_nothing(tok) -> None:  # noqa: ANN001
    ids = tok("one two.", add_special_tokens=False).input_ids
    stopped: list[str] = []
    chunks, _ = run(stream(tok, stop=["."], stopped=stopped), Completion(ids), [("f", ("stop", len(ids), 0))])
    assert stopped == [] and chunks[-1].finish_reason == "stop"  # the loop finished it already


def test_a_drain_detaches_at_the_delivered_offset_and_a_deadline_times_out(tok) -> None:  # noqa: ANN001
    ids = tok("alpha beta gamma", add_special_tokens=False).input_ids
    chunks, err = run(stream(tok), Completion(ids), [("t", (0, ids[:2], None)), (DRAIN, None)])
    assert isinstance(err, StreamDetached) and err.offset == 2 and err.request_id == "r1"
    chunks, err = run(s := stream(tok), Completion([]), [("f", ("deadline", 0, 0))])
    assert isinstance(err, QueueTimeout) and chunks == [] and s.done
