"""``benchmarks.cpu``'s roles: which process's CPU counts as the forward pass (compute) and which as serving."""

from __future__ import annotations

from benchmarks import cpu


def test_vllms_worker_is_its_compute_and_its_engine_core_serves() -> None:
    """vLLM 0.32 runs the model in a third process, ``VLLM::Worker`` (its log names it ``Worker``); counting it as
    ``other`` put vLLM's forward pass into its serving CPU (6.0 of 6.4 ms per output token)."""
    roles = {
        title: cpu.vllm_role(title.split())
        for title in ("VLLM::APIServer", "VLLM::EngineCore", "VLLM::Worker", "/usr/bin/python -m something")
    }
    assert roles == {
        "VLLM::APIServer": "api_server",
        "VLLM::EngineCore": "engine_core",
        "VLLM::Worker": "worker",
        "/usr/bin/python -m something": "other",
    }
    assert {r for r in roles.values() if r in cpu.COMPUTE} == {"worker"}
    assert cpu.vllm_role([".venv-vllm/bin/vllm", "serve", "/models/smol"]) == "api_server"


def test_pagedserves_executor_is_its_compute() -> None:
    assert cpu.pagedserve_role(["python", "-m", "executor_svc", "--port", "1"]) == "executor"
    assert cpu.pagedserve_role(["python", "-m", "scheduler_svc", "--role", "loop"]) == "loop"
    assert cpu.pagedserve_role(["python", "-m", "scheduler_svc"]) == "frontend"
    assert "executor" in cpu.COMPUTE and "frontend" not in cpu.COMPUTE
