"""``frontend.tokenize``: vLLM's /tokenize and /detokenize bodies checked on plain data, answers with the real
SmolLM2 tokenizer (the one every test model carries)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from transformers import AutoTokenizer

from executor_svc.model_store import resolve_model
from scheduler_svc.frontend.openai_request import ApiError
from scheduler_svc.frontend.tokenize import answer, parse_detokenize, parse_tokenize

MESSAGES = [{"role": "user", "content": "Hi"}]


def _param(call: Any) -> str | None:
    with pytest.raises(ApiError) as info:
        call()
    assert info.value.status == 400
    return info.value.body()["error"]["param"]


def test_defaults_are_vllm_s() -> None:
    text = parse_tokenize({"prompt": "hi"}, 100)
    assert (text.add_special_tokens, text.add_generation_prompt, text.return_token_strs) == (True, True, False)
    chat = parse_tokenize({"messages": MESSAGES, "model": "m"}, 100)
    assert chat.messages == MESSAGES and chat.model == "m" and not chat.add_special_tokens


def test_bad_bodies_name_the_field() -> None:
    for body, param in (
        ({}, "prompt"),
        ({"prompt": "a", "messages": MESSAGES}, "prompt"),
        ({"prompt": ["a"]}, "prompt"),
        ({"prompt": "a\ud800"}, "prompt"),
        ({"prompt": "x" * 101}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "y" * 100}]}, "messages"),
        ({"prompt": "a", "model": 3}, "model"),
        ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
        ({"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    ):
        assert _param(functools.partial(parse_tokenize, body, 100)) == param, body
    for body, param in (({}, "tokens"), ({"tokens": [0, 1.5]}, "tokens[1]"), ({"tokens": [10]}, "tokens[0]")):
        assert _param(functools.partial(parse_detokenize, body, 10)) == param, body
    assert parse_detokenize({"tokens": [0, 9]}, 10) == [0, 9]


def test_answers_are_the_tokenizer_s_and_the_chat_template_s() -> None:
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    got = answer(tok, parse_tokenize({"prompt": "Hello world", "return_token_strs": True}, 100), 512)
    assert got == {
        "count": 2,
        "max_model_len": 512,
        "tokens": tok("Hello world").input_ids,
        "token_strs": tok.convert_ids_to_tokens(tok("Hello world").input_ids),
    }
    templated = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat = answer(tok, parse_tokenize({"messages": MESSAGES}, 100), 512)
    assert chat["tokens"] == tok(templated, add_special_tokens=False).input_ids
    cont = [*MESSAGES, {"role": "assistant", "content": "Hel"}]
    body = {"messages": cont, "add_generation_prompt": False, "continue_final_message": True}
    assert tok.decode(answer(tok, parse_tokenize(body, 100), 512)["tokens"]).endswith("Hel")
