"""Each request's token history (prompt + outputs so far), for sampling that needs it.

Penalties count the tokens a request has seen, and a grammar matcher replays them;
the executor keeps them here so that a decode step sends one token, not the whole
context. The scheduler sends a request's history once (``SeqPlan.history``) when the
executor cannot have it (a swap-in, a new leader, a prefix-cache hit); every step
then appends the tokens it runs. Cleared with the block tables.
"""

from __future__ import annotations

from array import array


class Histories:
    def __init__(self) -> None:
        self._tokens: dict[str, array] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def set(self, request_id: str, tokens: list[int]) -> None:
        self._tokens[request_id] = array("l", tokens)

    def extend(self, request_id: str, tokens: list[int], at: int | None = None) -> None:
        """Append ``tokens`` (first dropping what it holds from position ``at`` on: drafts a step
        rejected); raises KeyError for a request whose history is not held."""
        held = self._tokens[request_id]
        if at is not None and len(held) > at:
            del held[at:]
        held.extend(tokens)

    def get(self, request_id: str) -> array | None:
        return self._tokens.get(request_id)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def clear(self) -> None:
        self._tokens.clear()
