"""What the device KV pool holds for one request: every block (nothing is reserved for a request
that runs alone; the scheduler's watermark applies only next to running work). Schedulers state the
model's context capped by it as ``max_model_len`` (``scheduler_svc/frontend/watch.py``).

An explicit ``--max-model-len`` the pool cannot hold is refused at start, as vLLM refuses it: such
an executor would accept prompts that can never run. Checked here, not on the scheduler, because the
executor is where the pool's size is known at start (profiled on CUDA); a scheduler starts before any
executor registers, and states the resulting limit in ``/v1/models``.
"""

from __future__ import annotations


class ContextTooLong(ValueError):
    """``--max-model-len`` is more than the KV pool holds for one request."""


def pool_tokens(device_blocks: int, block_size: int) -> int:
    """The tokens one request can hold: the whole device pool."""
    return device_blocks * block_size


def check_max_model_len(requested: int | None, device_blocks: int, block_size: int) -> None:
    """Raise ``ContextTooLong``, giving the number that fits, when ``requested`` is over the pool."""
    fits = pool_tokens(device_blocks, block_size)
    if requested is not None and requested > fits:
        raise ContextTooLong(
            f"--max-model-len {requested}: the KV pool holds {fits} tokens ({device_blocks} blocks of "
            f"{block_size}), so no request of {requested} tokens could ever run; use --max-model-len {fits} "
            "or less, or give the pool more memory (--kv-cache-memory, --gpu-memory-utilization)"
        )
