"""``pagedserve.heap.settle`` in a fresh interpreter (it changes the collector of the process it runs in)."""

from __future__ import annotations

import subprocess
import sys

from pagedserve import heap


def test_settle_freezes_the_startup_heap_and_spaces_young_collections() -> None:
    code = (
        "import gc; from pagedserve import heap; assert gc.get_freeze_count() == 0; heap.settle(); "
        "print(gc.get_freeze_count(), gc.get_threshold()[0], gc.isenabled())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    frozen, young, enabled = int(out[0]), int(out[1]), out[2]
    assert frozen > 1000 and young == heap.YOUNG_THRESHOLD and enabled == "True"
