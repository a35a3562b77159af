"""The request spec Redis stores (``state.codec``): its parameters come back as they went in."""

from __future__ import annotations

import json

from scheduler_svc.core.request import Params, Request
from scheduler_svc.state.codec import request_from, spec_json, stop_of


def test_issue_22_s_parameters_survive_the_spec() -> None:
    params = Params(
        max_tokens=9,
        include_stop_str_in_output=True,
        allowed_token_ids=(3, 5, 8),
        bad_words=((7,), (1, 2, 3)),
        logit_bias=((4, -1.5),),
    )
    spec = spec_json(Request("r", [1, 2], params), ["end"])
    back = request_from("r", {"spec": spec}, [])
    assert back.params == params and stop_of({"spec": spec}) == ["end"]
    plain = json.loads(spec_json(Request("p", [1], Params()), []))["params"]
    assert not {"include_stop_str_in_output", "allowed_token_ids", "bad_words"} & plain.keys(), "unset: not stored"
