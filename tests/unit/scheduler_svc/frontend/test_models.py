"""``frontend.models``: the id, the accepted names and the cards, on a watch holding plain values."""

from __future__ import annotations

from typing import Any

from scheduler_svc.frontend.models import Models
from scheduler_svc.frontend.validate import Limits


class _Watch:
    def __init__(self, model: str = "", model_path: str = "") -> None:
        self.model, self.model_path = model, model_path
        self.limits = Limits(384, 1000, 16, ((24, 512),)) if model else None


def _models(watch: _Watch, *served: str) -> Models:
    w: Any = watch
    return Models(w, served, 7)


def test_the_directory_is_the_id_without_served_names() -> None:
    m = _models(_Watch("tiny", "/models/tiny"))
    assert m.id == m.root == "/models/tiny" and m.accepts("/models/tiny") and m.accepts("tiny")
    assert not m.accepts("gpt-4o")
    assert m.cards() == [
        {
            "id": "/models/tiny",
            "object": "model",
            "created": 7,
            "owned_by": "pagedserve",
            "root": "/models/tiny",
            "parent": None,
            "max_model_len": 384,
        }
    ]


def test_served_names_the_first_is_the_id() -> None:
    m = _models(_Watch("tiny", "/models/tiny"), "chat", "alias")
    assert m.id == "chat" and [c["id"] for c in m.cards()] == ["chat", "alias"]
    assert all(m.accepts(n) for n in ("chat", "alias", "/models/tiny", "tiny")) and not m.accepts("other")


def test_nothing_is_listed_before_an_executor_told_the_model() -> None:
    assert _models(_Watch(), "chat").cards() == [] and not _models(_Watch()).known


def test_an_executor_without_a_path_reports_the_directory_s_name() -> None:
    m = _models(_Watch("tiny"))
    assert m.id == m.root == "tiny"
