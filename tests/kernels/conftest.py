"""Run the Triton kernels through the CPU interpreter.

``@triton.jit`` picks interpreter or compiler when a kernel is *decorated*,
i.e. when ``kernels.triton_ops`` is imported, so the flag is set here at
import time and the module is reloaded if something imported it earlier.
Triton is a dev dependency: if it cannot be imported, collecting these tests
fails (an error, not a skip).
"""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402,F401  (must fail loudly when missing)

if "kernels.triton_ops" in sys.modules and not sys.modules["kernels.triton_ops"]._INTERPRETING:
    importlib.reload(sys.modules["kernels.triton_ops"])
