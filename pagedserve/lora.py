"""LoRA adapters as both services see them: where one lives, what it is, what it is called.

An adapter is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``).
Its identity is the sha256 of those two files' bytes (``digest``), not its name: the
digest goes into the prefix-cache block hashes (``scheduler_svc/core/prefix.py``), so a
name re-registered with new weights never reuses the old KV, and two names for the same
weights share it. The executor checks the digest of what it loads against the one the
plan names, so a directory overwritten in place is refused rather than served stale.

Torch-free: the scheduler reads only the config and hashes the bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_NAME = 256  # characters of an adapter name
# PEFT's module names this server applies deltas to (the Llama family's linear layers).
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


class AdapterError(ValueError):
    """An adapter directory this server cannot serve: the message says why."""


@dataclass(frozen=True, slots=True)
class Adapter:
    """A registered adapter: its name, the directory executors load it from, its identity and rank."""

    name: str
    path: str
    digest: str  # sha256 hex of adapter_config.json + adapter_model.safetensors
    rank: int

    def to_json(self) -> str:
        return json.dumps({"path": self.path, "digest": self.digest, "rank": self.rank})

    @classmethod
    def from_json(cls, name: str, text: str | bytes) -> Adapter:
        d = json.loads(text)
        return cls(name, str(d["path"]), str(d["digest"]), int(d["rank"]))


def digest_of(config: bytes, weights: bytes) -> str:
    """The adapter's identity: both files, each length-prefixed so their boundary is unambiguous."""
    h = hashlib.sha256(b"pagedserve-lora-v1\0")
    for part in (config, weights):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def check_config(config: dict[str, Any], max_rank: int) -> int:
    """The adapter's rank, or AdapterError for what the executor does not apply exactly."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"rank r={rank!r} is not a positive integer")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} exceeds --max-lora-rank {max_rank}")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise AdapterError(f"{key} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config.get('bias')!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if config.get(key):
            raise AdapterError(f"{key} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str) or not set(targets) <= TARGETS:
        raise AdapterError(f"target_modules {targets!r}: only {sorted(TARGETS)} are supported")
    return rank


def read(name: str, path: str, max_rank: int) -> Adapter:
    """Register-time look at an adapter directory: its digest and rank (AdapterError if unusable)."""
    root = Path(path)
    try:
        config_bytes = (root / CONFIG).read_bytes()
        weights = (root / WEIGHTS).read_bytes()
    except OSError as exc:
        raise AdapterError(f"cannot read the adapter at {path}: {exc.strerror or exc}") from exc
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise AdapterError(f"{CONFIG} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG} is not a JSON object")
    return Adapter(name, path, digest_of(config_bytes, weights), check_config(config, max_rank))


def parse_modules(specs: list[str]) -> list[tuple[str, str]]:
    """``--lora-modules name=path`` (vLLM's form; its JSON form too) as (name, path) pairs."""
    out = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            d = json.loads(spec)
            name, path = d.get("name"), d.get("path")
        else:
            name, sep, path = spec.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {spec!r}: expected name=path")
        if not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected name=path")
        out.append((str(name), str(path)))
    return out
