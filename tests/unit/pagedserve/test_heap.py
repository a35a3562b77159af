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


# 64 MiB zeroed after ``huge_pages``, as a CPU KV pool is: on 4 KiB pages that is 16,384 page faults, on 2 MiB pages 32.
HUGE = """
import resource, torch
from pagedserve import heap
t = torch.empty(16 << 20)
small = heap.huge_pages(torch.empty(1 << 10))
asked = heap.huge_pages(t)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t.zero_()
print(small, asked, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_pool_asked_for_huge_pages_faults_in_2_mib_at_a_time() -> None:
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages in this kernel")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine ([never])")
    out = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, check=True).stdout.split()
    small, asked, count = out[0] == "True", out[1] == "True", int(out[2])
    assert not small, "a tensor inside one huge page has no whole huge page to ask for"
    assert asked
    # 575 here; at most three quarters of 16,384 leaves room for a huge page Linux could not find (4 KiB instead)
    assert count < 16384 * 3 // 4, f"{count} page faults zeroing 64 MiB: not on 2 MiB pages"
