"""One check at start-up: does Redis accept the credentials in ``--redis-url``?

Both services call ``require(url)`` once before they do anything else. redis-py
takes a password (``redis://:PASSWORD@host:port/0``) or an ACL user
(``redis://USER:PASSWORD@host:port/0``) from the URL, and TLS from ``rediss://``
(with ``ssl_ca_certs=...``, ``ssl_certfile=...``, ``ssl_keyfile=...`` in the query),
wherever a client is built from the URL. Wrong or missing credentials would
otherwise surface as a traceback in a background task, or as a loop that
retries forever: here they end the process with one clear log line and
``EXIT_CODE``. A Redis that is merely unreachable is not an error here (the
services wait for it, as after a Redis restart); it is logged and start-up goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis import exceptions

log = logging.getLogger("pagedserve.redis")

# What argparse uses for a bad command line: the configuration is wrong, restarting won't help.
EXIT_CODE = 2
CONNECT_TIMEOUT_S = 5.0


@dataclass(slots=True, frozen=True)
class Refusal:
    """Why Redis refused us, as one log line."""

    message: str


def where(url: str) -> str:
    """``host:port`` of a Redis URL, never its credentials."""
    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"


def explain(url: str, error: Exception) -> Refusal | None:
    """The refusal ``error`` means for ``url``, or None when it is not about credentials (pure)."""
    scheme = urlsplit(url).scheme or "redis"
    hint = (
        f"put them in --redis-url as {scheme}://:PASSWORD@host:port/0, "
        f"or {scheme}://USER:PASSWORD@host:port/0 for an ACL user"
    )
    text = str(error)
    if isinstance(error, exceptions.AuthenticationError):
        code = "NOAUTH" if "authenticated" in text or "NOAUTH" in text or "required" in text.lower() else "WRONGPASS"
        return Refusal(f"redis at {where(url)} refused our credentials ({code}: {text}): {hint}")
    if isinstance(error, exceptions.AuthenticationWrongNumberOfArgsError | exceptions.NoPermissionError):
        return Refusal(
            f"redis at {where(url)} refused our credentials ({text}): {hint}; an ACL user needs "
            "all keys, channels and commands (~* &* +@all)"
        )
    if isinstance(error, exceptions.ResponseError) and "without any password configured" in text:
        return Refusal(f"redis at {where(url)} has no password but --redis-url carries one: drop it from the URL")
    return None


async def check(url: str) -> Refusal | None:
    """Connect once and PING; a refusal if the credentials are missing or wrong."""
    client = aioredis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S)
    try:
        await client.ping()
    except exceptions.RedisError as e:
        refusal = explain(url, e)
        if refusal is None:
            log.warning("redis at %s not reachable at start (%s); going on, it is retried", where(url), e)
        return refusal
    finally:
        await client.aclose()
    return None


async def require(url: str | None) -> None:
    """Exit with one clear line if Redis refuses the URL's credentials; nothing if ``url`` is None."""
    if not url:
        return
    refusal = await check(url)
    if refusal is not None:
        log.error("%s", refusal.message)
        raise SystemExit(EXIT_CODE)
