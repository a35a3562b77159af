"""Adapter identity and registration checks (pagedserve/lora.py), on plain files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve import lora

CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none"}


def adapter_dir(root: Path, name: str, weights: bytes, **config: object) -> str:
    d = root / name
    d.mkdir()
    (d / lora.CONFIG).write_text(json.dumps(CONFIG | config))
    (d / lora.WEIGHTS).write_bytes(weights)
    return str(d)


def test_identity_is_the_content_not_the_name_or_place(tmp_path: Path) -> None:
    a = lora.read("a", adapter_dir(tmp_path, "x", b"w1"), 16)
    b = lora.read("b", adapter_dir(tmp_path, "y", b"w1"), 16)
    c = lora.read("a", adapter_dir(tmp_path, "z", b"w2"), 16)
    d = lora.read("a", adapter_dir(tmp_path, "v", b"w1", lora_alpha=32), 16)
    assert a.digest == b.digest, "two names for the same weights are one adapter"
    assert len({a.digest, c.digest, d.digest}) == 3, "other weights or another config are another adapter"
    assert a.rank == 8
    assert lora.Adapter.from_json("a", a.to_json()) == a


def test_the_file_boundary_is_part_of_the_digest() -> None:
    assert lora.digest_of(b"ab", b"c") != lora.digest_of(b"a", b"bc")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"r": 32}, "exceeds --max-lora-rank 16"),
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"target_modules": ["lm_head"]}, "target_modules"),
        ({"peft_type": "IA3"}, "LORA"),
    ],
)
def test_what_cannot_be_applied_exactly_is_refused(tmp_path: Path, change: dict[str, object], words: str) -> None:
    with pytest.raises(lora.AdapterError, match=words.replace("-", r"\-")):
        lora.read("a", adapter_dir(tmp_path, "x", b"w", **change), 16)


def test_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(lora.AdapterError, match="cannot read"):
        lora.read("a", str(tmp_path / "nope"), 16)


def test_lora_modules_in_vllms_forms() -> None:
    assert lora.parse_modules(["a=/x", '{"name": "b", "path": "/y"}']) == [("a", "/x"), ("b", "/y")]
    with pytest.raises(ValueError, match="name=path"):
        lora.parse_modules(["nopath"])
