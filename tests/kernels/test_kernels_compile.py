"""The kernels compile for a real GPU (sm_90), checked on a machine without one.

The interpreter runs the kernels' logic but not the GPU compiler's rules, so
a subprocess without ``TRITON_INTERPRET`` compiles each kernel to a cubin
(``sm90_compile.py``). The bf16 attention configurations, the production
path, must also fit in registers (no local-memory stack from spills).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    usage = json.loads(done.stdout)
    assert len(usage) == 7
    for name, line in usage.items():
        assert re.search(r"REG:\d+", line), (name, line)
        if "bf16" in name:
            assert re.search(r"\bSTACK:0\b", line), (name, line)
