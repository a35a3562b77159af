"""The namespace's LoRA registry on a dict standing in for Redis: refusals name what is wrong."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from pagedserve import lora
from pagedserve.keys import Keys
from scheduler_svc.frontend.loras import LoraRegistry
from scheduler_svc.frontend.refusals import Kind, Refusal


class FakeRedis:
    def __init__(self) -> None:
        self.h: dict[str, dict[str, str]] = {}

    async def hget(self, key: str, field: str) -> str | None:
        return self.h.get(key, {}).get(field)

    async def hset(self, key: str, field: str, value: str) -> int:
        self.h.setdefault(key, {})[field] = value
        return 1

    async def hdel(self, key: str, field: str) -> int:
        return int(self.h.get(key, {}).pop(field, None) is not None)

    async def hgetall(self, key: str) -> dict[str, str]:
        return dict(self.h.get(key, {}))


def adapter(root: Path, r: int = 8) -> str:
    root.mkdir()
    (root / lora.CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": r, "target_modules": ["q_proj"]}))
    (root / lora.WEIGHTS).write_bytes(b"weights")
    return str(root)


def registry(enabled: bool = True) -> tuple[LoraRegistry, FakeRedis]:
    fake = FakeRedis()
    return LoraRegistry(fake, Keys("t"), enabled, max_rank=16), fake  # type: ignore[arg-type]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_registered_names_resolve_to_their_content(tmp_path: Path) -> None:
    reg, fake = registry()
    got = run(reg.register("a", adapter(tmp_path / "a")))
    assert fake.h[Keys("t").loras]["a"] == got.to_json()
    assert run(reg.resolve("a")) == got
    assert [a.name for a in run(reg.all())] == ["a"]
    run(reg.unregister("a"))
    with pytest.raises(Refusal) as exc:
        run(reg.resolve("a", "model"))
    assert exc.value.kind == Kind.MODEL_NOT_FOUND and exc.value.field == "model" and "`a`" in exc.value.reason


@pytest.mark.parametrize(
    ("name", "path", "field", "words"),
    [("a", "", "lora_path", "must be set"), ("", "x", "lora_name", "characters"), ("a", "/nope", "lora_path", "read")],
)
def test_bad_registrations_name_the_field(name: str, path: str, field: str, words: str) -> None:
    reg, _ = registry()
    with pytest.raises(Refusal) as exc:
        run(reg.register(name, path))
    assert exc.value.kind == Kind.INVALID_ARGUMENT and exc.value.field == field and words in exc.value.reason


def test_a_rank_over_the_limit_and_lora_off_are_refused(tmp_path: Path) -> None:
    reg, _ = registry()
    with pytest.raises(Refusal, match="exceeds --max-lora-rank 16"):
        run(reg.register("big", adapter(tmp_path / "big", r=32)))
    off, _ = registry(enabled=False)
    with pytest.raises(Refusal, match="--enable-lora") as exc:
        run(off.resolve("a"))
    assert exc.value.kind == Kind.INVALID_ARGUMENT
    assert run(off.all()) == []
    with pytest.raises(Refusal) as exc:
        run(reg.unregister("never"))
    assert exc.value.kind == Kind.MODEL_NOT_FOUND
