"""``pagedserve.heap`` in a fresh interpreter (each of its calls changes the process it runs in)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from pagedserve import heap


def test_settle_freezes_the_startup_heap_and_spaces_young_collections() -> None:
    code = (
        "import gc; from pagedserve import heap; assert gc.get_freeze_count() == 0; heap.settle(); "
        "print(gc.get_freeze_count(), gc.get_threshold()[0], gc.isenabled())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    frozen, young, enabled = int(out[0]), int(out[1]), out[2]
    assert frozen > 1000 and young == heap.YOUNG_THRESHOLD and enabled == "True"


# Buffers of 2-10 MiB, four at a time, freed and made again: a CPU step's temporaries in miniature (each layer's
# gathered K/V and activations). The first round may fault its pages in; the next twenty must reuse them.
CYCLES = """
import resource
from pagedserve import heap
kept = {keep} and heap.keep_freed_memory()
def cycle(mib):
    bufs = [bytearray((mib + i) << 20) for i in range(4)]
    del bufs
cycle(6)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for k in range(20):
    cycle(2 + k % 5)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(keep: bool) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", CYCLES.format(keep=keep)], capture_output=True, text=True, check=True)
    kept, count = out.stdout.split()
    return kept == "True", int(count)


def test_kept_freed_memory_serves_the_next_steps_temporaries_without_page_faults() -> None:
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("keep_freed_memory tunes glibc's malloc only")
    kept, count = faults(keep=True)
    assert kept, "glibc refused the thresholds"
    touched = sum(2 + k % 5 + i for k in range(20) for i in range(4)) * 256  # pages of 4 KiB
    assert count < touched / 100, f"{count} page faults for {touched} pages touched"
    _, default = faults(keep=False)
    assert default > 10 * max(count, 1), "glibc's defaults unmap what was freed (the reason for the call)"
