"""One position's logprobs, the one form they take from the executor's reply to the client's answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class Logprob(NamedTuple):
    """The token, its log-probability, its rank (1 + how many tokens were more likely) and the top
    alternatives (ids and log-probabilities, most likely first). A tuple, so Redis stores it as the
    JSON array ``[token_id, logprob, rank, top_ids, top_logprobs]`` and ``of`` reads it back."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]

    @classmethod
    def of(cls, stored: Sequence[Any]) -> Logprob:
        """From its stored (decoded JSON) form."""
        token_id, logprob, rank, top_ids, top_logprobs = stored
        return cls(int(token_id), float(logprob), int(rank), tuple(top_ids), tuple(top_logprobs))
