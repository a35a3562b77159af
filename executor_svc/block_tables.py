"""The executor's copy of each request's block table, kept in step with plan diffs.

A decode step appends a block every ``block_size`` tokens, so a plan carries the
new blocks only; keeping a tensor per request, rebuilt only when it grows,
makes the per-step cost independent of context length.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence


class UnknownTable(LookupError):
    """A diff arrived for a table this executor does not hold (it restarted, or a
    scheduler took over): the scheduler must resend the full table."""


class BlockTables:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._lists: dict[str, list[int]] = {}
        self._tensors: dict[str, torch.Tensor] = {}

    def apply(self, request_id: str, blocks: list[int], full: bool) -> None:
        if blocks and max(blocks) >= self.num_blocks:
            raise ValueError(f"{request_id}: block id out of range")
        if full:
            self._lists[request_id] = list(blocks)
        elif request_id not in self._lists:
            raise UnknownTable(request_id)
        elif blocks:
            self._lists[request_id].extend(blocks)
        else:
            return
        self._tensors[request_id] = torch.tensor(self._lists[request_id], dtype=torch.int32)

    def clear(self) -> None:
        self._lists.clear()
        self._tensors.clear()

    def forget(self, request_id: str) -> None:
        self._lists.pop(request_id, None)
        self._tensors.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._lists)

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._lists[request_id])

    def stacked(self, request_ids: list[str]) -> torch.Tensor:
        """``[S, max_blocks]`` int32, rows padded with block 0 (never read past a context)."""
        return pad_sequence([self._tensors[r] for r in request_ids], batch_first=True, padding_value=0)
