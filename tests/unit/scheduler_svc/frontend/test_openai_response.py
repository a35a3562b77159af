"""pagedserve.v1 -> OpenAI JSON (``scheduler_svc.frontend.openai_response``) on plain data: the exact response and
stream-chunk shapes, logprobs included. No processes, no I/O."""

from __future__ import annotations

from typing import Any

from scheduler_svc.core.logprob import Logprob
from scheduler_svc.frontend import openai_request as proto
from scheduler_svc.frontend import openai_response as answer
from scheduler_svc.frontend.streams import Chunk
from tests.unit.scheduler_svc.frontend.test_openai_request import M, chat, completion


def _shape(body: dict[str, Any], is_chat: bool) -> answer.Shape:
    return answer.Shape(proto.parse(body, chat=is_chat), "rid", 1700, M, [[1, 2, 3]])


CHUNKS = [Chunk("rid", [10], "Hel", 0), Chunk("rid", [11], "", 1), Chunk("rid", [12], "lo", 2, "length", 3, 3)]


def test_non_streaming_bodies() -> None:
    done = answer.Collected()
    for c in CHUNKS:
        done.add(c)
    assert _shape(completion(), False).body([done]) == {
        "id": "cmpl-rid",
        "object": "text_completion",
        "created": 1700,
        "model": M,
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 3,
            "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    body = _shape(chat(return_token_ids=True), True).body([done])
    assert body["id"] == "chatcmpl-rid" and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "logprobs": None,
            "finish_reason": "length",
            "token_ids": [10, 11, 12],
        }
    ]
    assert body["prompt_token_ids"] == [1, 2, 3]


def test_chat_stream_chunks_with_usage() -> None:
    shape = _shape(chat(stream=True, stream_options={"include_usage": True}), True)
    events = [*shape.opening(), *(e for c in CHUNKS for e in shape.events(c)), *shape.closing()]
    head = {"id": "chatcmpl-rid", "object": "chat.completion.chunk", "created": 1700, "model": M}
    assert events == [
        head
        | {
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
            "usage": None,
        },
        head
        | {
            "choices": [{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}],
            "usage": None,
        },
        # the chunk with no text yet is skipped
        head
        | {
            "choices": [{"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": "length"}],
            "usage": None,
        },
        head
        | {
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": 3,
                "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        },
    ]


def test_completion_stream_chunks_carry_token_ids_when_asked() -> None:
    shape = _shape(completion(stream=True, return_token_ids=True), False)
    events = [*shape.opening(), *(e for c in CHUNKS for e in shape.events(c)), *shape.closing()]
    assert [e["choices"][0]["token_ids"] for e in events] == [[10], [11], [12]]
    assert [e["choices"][0]["text"] for e in events] == ["Hel", "", "lo"]
    assert all("usage" not in e for e in events), "no usage chunk unless include_usage"


LP_CHUNKS = [
    Chunk(
        "rid",
        [10],
        "Hel",
        0,
        logprobs=[Logprob.of([10, -0.5, 1, [10, 11], [-0.5, -1.5]])],
        prompt_logprobs=[Logprob.of([2, -3.0, 4, [9], [-0.1]]), Logprob.of([3, -2.0, 1, [3], [-2.0]])],
    ),
    Chunk("rid", [11], "", 1, logprobs=[Logprob.of([11, -0.25, 2, [12, 11], [-0.2, -0.25]])]),
    Chunk("rid", [12], "lo", 2, "length", 3, 3, logprobs=[Logprob.of([12, -0.125, 1, [12, 10], [-0.125, -3.0]])]),
]


DECODE = {10: "Hel", 11: "", 12: "lo", 9: "x", 2: "a", 3: "b"}


def test_completion_logprobs_in_openai_shape_streamed_or_not() -> None:
    shape = answer.Shape(
        proto.parse(completion(logprobs=2, prompt_logprobs=1), chat=False),
        "rid",
        1700,
        M,
        [[1, 2, 3]],
        decode=DECODE.__getitem__,
    )
    done = answer.Collected()
    for c in LP_CHUNKS:
        done.add(c)
    choice = shape.body([done])["choices"][0]
    assert choice["logprobs"] == {
        "tokens": ["Hel", "", "lo"],
        "token_logprobs": [-0.5, -0.25, -0.125],
        "top_logprobs": [{"Hel": -0.5, "": -1.5}, {"lo": -0.2, "": -0.25}, {"lo": -0.125, "Hel": -3.0}],
        "text_offset": [0, 3, 3],
    }
    assert choice["prompt_logprobs"] == [
        None,
        {
            "9": {"logprob": -0.1, "rank": 1, "decoded_token": "x"},
            "2": {"logprob": -3.0, "rank": 4, "decoded_token": "a"},
        },
        {"3": {"logprob": -2.0, "rank": 1, "decoded_token": "b"}},
    ]
    streamed = answer.Shape(shape.parsed, "rid", 1700, M, [[1, 2, 3]], decode=DECODE.__getitem__)
    events = [e for c in LP_CHUNKS for e in streamed.events(c)]
    assert len(events) == 2, "the token with no text yet travels with the next chunk"
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == ["Hel", "", "lo"]
    assert [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]] == [0, 3, 3]
    late = answer.Shape(shape.parsed, "rid", 1700, M, [[1, 2, 3]], decode=DECODE.__getitem__)
    first_no_text = [
        Chunk("rid", [11], "", 0, logprobs=LP_CHUNKS[1].logprobs, prompt_logprobs=LP_CHUNKS[0].prompt_logprobs),
        *LP_CHUNKS[2:],
    ]
    events = [e for c in first_no_text for e in late.events(c)]
    assert len(events) == 1 and len(events[0]["choices"][0]["prompt_logprobs"]) == 3, "held with the tokens"


def test_chat_logprobs_in_openai_shape() -> None:
    shape = answer.Shape(
        proto.parse(chat(logprobs=True, top_logprobs=2), chat=True),
        "rid",
        1700,
        M,
        [[1, 2, 3]],
        decode=DECODE.__getitem__,
    )
    done = answer.Collected()
    for c in LP_CHUNKS:
        done.add(c)
    content = shape.body([done])["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "Hel",
        "logprob": -0.5,
        "bytes": [72, 101, 108],
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
            {"token": "", "logprob": -1.5, "bytes": []},
        ],
    }
    assert [c["logprob"] for c in content] == [-0.5, -0.25, -0.125]
