"""Keep the heaps off the step path: CPython's cyclic garbage collector, and the C allocator's
returning of freed memory to the kernel.

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

glibc's malloc serves a block of more than its mmap threshold (128 KiB at first, raised by frees
up to 32 MiB) with its own mmap, unmapped again when freed, and gives the top of its heap back to
the kernel past its trim threshold. A CPU step's temporaries (each layer's gathered K/V, its
activations: MBs each, thousands a step) then page-fault into fresh zeroed pages every step:
decode attention over 16 sequences of 400 tokens measured 16-140 ms per 30 layers against 15-17
with the memory kept (a microbenchmark, 2026-12-06), the cost and its spread coming from the
kernel. vLLM preloads tcmalloc on CPU for this; ``keep_freed_memory`` gets the same from glibc in
the running process (``mallopt``: no preload, no re-exec, so forked warm starts keep it too).
"""

from __future__ import annotations

import ctypes
import gc
import logging

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 20_000  # net container allocations between young collections (CPython's default: 700)


def settle() -> None:
    """Once the process is up: collect, freeze what is left, and space the young collections out."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks above it (a KV pool, weights) still get their own mapping
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before any is given back


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse rather than give it back to the kernel (the
    module's docstring says why). False where the C library is not glibc (nothing changes there)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.warning("mallopt refused the thresholds; freed memory goes back to the kernel as before")
    return done
