"""``/v1/responses``' stored conversations: what ``previous_response_id`` continues and ``GET
/v1/responses/{id}`` returns, kept in Redis (``RedisStore.put_response``) for ``--result-ttl``.

One value per response: the Response object and the chat messages of its whole conversation (the history
it continued, its input, its answer), so a follow-up is one read and never a walk back through ids."""

from __future__ import annotations

import json
from typing import Any, cast

from scheduler_svc.frontend import responses
from scheduler_svc.frontend.openai_request import bad, refused
from scheduler_svc.frontend.refusals import Kind
from scheduler_svc.frontend.responses import Call
from scheduler_svc.state.store import RedisStore


class Conversations:
    def __init__(self, store: RedisStore) -> None:
        self.store = store

    async def history(self, response_id: str | None) -> list[dict[str, Any]]:
        """The messages a ``previous_response_id`` continues (none without one); a 400 naming it if gone."""
        if response_id is None:
            return []
        if (kept := await self.store.get_response(response_id)) is None:
            raise bad("previous_response_id", f"no stored response has the id {response_id!r} (or it expired)")
        return cast(list[dict[str, Any]], json.loads(kept)["messages"])

    async def keep(self, call: Call, history: list[dict[str, Any]], got: dict[str, Any]) -> None:
        """Store ``got`` with its conversation, unless the request said ``store: false``."""
        if call.store:
            kept = {"response": got, "messages": responses.conversation(call, history, got)}
            await self.store.put_response(got["id"], json.dumps(kept, ensure_ascii=False))

    async def response(self, response_id: str) -> dict[str, Any]:
        """A stored Response object; NOT_FOUND (404) once it expired or was never stored."""
        if (kept := await self.store.get_response(response_id)) is None:
            raise refused(Kind.NOT_FOUND, f"no stored response has the id {response_id!r} (or it expired)")
        return cast(dict[str, Any], json.loads(kept)["response"])
