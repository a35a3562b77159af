"""Keep CPython's cyclic garbage collector off the step path.

The collector scans the young objects every 700 net container allocations and,
every hundred or so of those, every object the process holds. A service holds
most of its objects from startup on (grpc, redis, torch and transformers'
modules, the model): a full collection over them took ~30 ms in a loops process
and ~150-350 ms in an executor on this 2-core machine, a pause in the middle of
a step that the executor, and on a GPU the device, waits out. As vLLM's engine
core does once it is up, each service freezes what exists after startup (moved
to a permanent generation: never scanned again, which is all right for what
lives as long as the process) and collects the young objects less often, so a
collection scans only what the steps made since.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000  # net container allocations between young collections (CPython's default: 700)


def settle() -> None:
    """Once the process is up: collect, freeze what is left, and space the young collections out."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
