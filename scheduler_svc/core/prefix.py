"""Block hashes for automatic prefix caching: pure, I/O-free.

A full block of ``block_size`` tokens is named by a sha256 chained over its
parent block's hash and its own token ids, as vLLM v1 does: two blocks share
a hash only if every token before and in them is the same, so a hash names a
whole prefix. The chain starts from a root that mixes in the request's
``cache_salt``, so requests with different salts share no block at all
(vLLM moved to sha256 after collisions of a weaker hash were shown to leak
one request's KV into another's answer). A request on a LoRA adapter starts from
a root that also mixes in the adapter's digest (``pagedserve/lora.py``): its KV is
the adapter's, so it is shared only with requests on the same weights.

Tokens are encoded as fixed-width little-endian uint32 and the parent as its
32 raw bytes, so the encoding is unambiguous. Hashes travel to Redis as hex.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

MAX_SALT = 256  # characters of cache_salt (GenerateRequest.cache_salt)


def root(salt: str | None, adapter: str = "") -> bytes:
    """The parent of a request's first block: distinct per salt ('' and None are no salt) and per
    LoRA adapter digest ('' is the base model, whose root is what it was before adapters)."""
    salted = (salt or "").encode("utf-8", "surrogatepass")
    if not adapter:
        return hashlib.sha256(b"pagedserve-prefix-v1\0" + salted).digest()
    # Another tag, and the digest at a fixed length before the salt: no salt can imitate an adapter.
    return hashlib.sha256(b"pagedserve-prefix-lora-v1\0" + bytes.fromhex(adapter) + salted).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    ids = array("I", tokens)
    if ids.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit here")
    return hashlib.sha256(parent + ids.tobytes()).digest()


def extend(
    hashes: list[bytes], tokens: Sequence[int], salt: str | None, block_size: int, upto: int, adapter: str = ""
) -> list[bytes]:
    """Grow ``hashes`` (the chain of ``tokens``' first full blocks) to ``upto`` blocks; returns it.

    ``tokens`` must hold at least ``upto * block_size`` ids."""
    parent = hashes[-1] if hashes else root(salt, adapter)
    for i in range(len(hashes), upto):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def lookup_limit(num_tokens: int, block_size: int) -> int:
    """Full blocks a cache hit may cover: at least one token is always left to compute,
    so the step that admits the request has logits to sample from (vLLM recomputes the
    last token when a whole prompt hits)."""
    return max(0, num_tokens - 1) // block_size


def prompt_hashes(prompt: Sequence[int], salt: str | None, block_size: int, adapter: str = "") -> list[str]:
    """Hex hashes of a prompt's cacheable blocks: what placement compares with each executor's cache."""
    return [h.hex() for h in extend([], prompt, salt, block_size, lookup_limit(len(prompt), block_size), adapter)]
