"""The quick and full benchmark configurations (shared by the CLI and the orchestration)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Config:
    name: str
    num_requests: int
    scale: float
    max_total_len: int
    kv_budget_tokens: int
    overhead_running: list[int]
    overhead_waiting: list[int]
    overhead_window_s: float
    preemption_lengths: list[int]
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    scale_out_executors: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    scale_out_running: int = 64  # per executor
    scale_out_window_s: float = 5.0
    scale_out_step_ms: float = 20.0  # the stub executors' simulated step
    kv_spread_budget_tokens: int = 1024  # per executor
    kv_spread_requests: int = 48


ARMS = ("pagedserve", "hf_static", "hf_continuous", "overhead", "scale_out", "kv_spread")
QUICK = Config("quick", 64, 0.125, 512, 2048, [1, 64, 256], [0, 1024, 2048], 1.5, [32, 128, 512])
FULL = Config("full", 256, 0.25, 1024, 4096, [1, 16, 64, 128, 256], [0, 256, 1024, 4096], 4.0, [16, 64, 256, 1024],
              scale_out_window_s=10.0, kv_spread_requests=96)


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return 2 * c["num_hidden_layers"] * (c.get("num_key_value_heads") or heads) * head_dim * dtype_bytes
