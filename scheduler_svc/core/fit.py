"""How many KV blocks tokens take, and whether a request can ever fit a pool: one answer for the
frontend's admission check (RESOURCE_EXHAUSTED when no pool could hold it), the placement of queued
requests, and a loop's scheduler."""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks that hold ``num_tokens`` tokens (the last one partly filled)."""
    return -(-num_tokens // block_size)


def fits_ever(
    num_prompt: int, max_tokens: int, num_tokens: int, block_size: int, pool_blocks: int, max_model_len: int
) -> bool:
    """Whether a request fits a pool at its longest: its ``num_tokens`` so far leave the context room for
    one more, and prompt + ``max_tokens`` (capped by the context) fit the whole device pool."""
    total = min(num_prompt + max_tokens, max_model_len)
    return num_tokens < max_model_len and blocks_for(total, block_size) <= pool_blocks
