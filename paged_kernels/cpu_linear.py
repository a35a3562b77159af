"""fp32 linear layers through oneDNN called directly: ``--cpu-linear dnnl`` (``auto``'s choice where it builds).

torch reaches oneDNN through ``torch.ops.mkldnn._linear_pointwise`` (ideep): every call looks its primitive up by a
key it builds from the shapes, allocates a scratchpad and goes through the dispatcher, ~20 us before any arithmetic
on a 2-core AVX2 VM (a 64 x 64 product), ~2.4 ms over a SmolLM2 decode step's 121 products. vLLM's CPU backend
calls oneDNN itself (``onednn_mm``: its own handle, primitives cached by row count), and its step was 4-6 ms shorter
than ours at 1-32 rows on that machine, most of it there. torch does not export oneDNN's symbols, so this module
builds a small shim (``cpu/dnnl_linear.cpp``) against oneDNN's own release (the ``onednn-cpu-gomp`` and
``onednn-devel-cpu-gomp`` wheels: threaded by GNU OpenMP, whose ``libgomp.so.1`` resolves to the one torch already
loaded, so both share one thread team and one ``torch.set_num_threads``). Measured there, one thread team of 2:
a decode step's 121 products 23.7 -> 20.5 ms at 1 row, 36.4 -> 28.6 at 8, 76.3 -> 59.6 at 32 (its kernels'
blocking suits these shapes better too).

Each output element is the dot product of one input row with one weight row, reduced over the input features in the
kernel's order: it does not depend on how many rows or output columns a call has (``tests/unit/executor_svc/
test_linear.py``), so fused q/k/v slices equal the separate products and a token's logits do not depend on its
batch. The bits differ from torch's oneDNN in the last place (another release, another blocking), as torch's differ
from MKL's; greedy output stays token-identical to transformers' (the oracle tests run this path).

Built at first use into the cache directory, like the attention kernel; the library's name carries a digest of the
source, the flags and oneDNN's version header. ``KernelUnavailable`` says why it cannot be built or loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from paged_kernels.cpu_build import KernelUnavailable, compile_library

SOURCE = Path(__file__).with_name("cpu") / "dnnl_linear.cpp"
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")
HEADER = Path("oneapi") / "dnnl" / "dnnl_version.h"
_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class OneDNN:
    """Where oneDNN's headers and library are."""

    include: Path
    lib: Path


def find() -> OneDNN | None:
    """oneDNN 3 as its wheels install it (``include/`` and ``lib/`` under the environment's prefix), or None."""
    for root in dict.fromkeys((Path(sys.prefix), Path(sysconfig.get_path("data")))):
        include, lib = root / "include", root / "lib"
        if (include / HEADER).exists() and (lib / "libdnnl.so.3").exists():
            return OneDNN(include, lib)
    return None


def library_path(cache_dir: Path, dnnl: OneDNN) -> Path:
    key = SOURCE.read_bytes() + " ".join(FLAGS).encode() + (dnnl.include / HEADER).read_bytes() + bytes(dnnl.lib)
    return cache_dir / "kernels" / f"dnnl_linear-{hashlib.sha256(key).hexdigest()[:16]}.so"


class Library:
    """The shim, loaded: ``new``/``pack`` a weight, ``run`` a product."""

    def __init__(self, path: Path) -> None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise KernelUnavailable(f"cannot load {path}: {e}") from e
        self._error = lib.dnnl_linear_error
        self._error.restype, self._error.argtypes = ctypes.c_char_p, []
        self.new = self._checked(lib.dnnl_linear_new, [_I, _I, ctypes.POINTER(_P), ctypes.POINTER(_I)])
        self.pack = self._checked(lib.dnnl_linear_pack, [_P, _P, _P])
        self.run = self._checked(lib.dnnl_linear_run, [_P, _P, _P, _P, _P, _I])
        self.free = lib.dnnl_linear_free
        self.free.restype, self.free.argtypes = None, [_P]

    def _checked(self, fn: ctypes._CFuncPtr, argtypes: list) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
        fn.errcheck = self._raise
        return fn

    def _raise(self, status: int, fn: object, args: object) -> int:
        if status != 0:
            raise RuntimeError(self._error().decode(errors="replace"))
        return status


@cache
def load(cache_dir: Path) -> Library:
    """The shim, compiled into ``cache_dir/kernels`` unless a build of this source against this oneDNN is there."""
    dnnl = find()
    if dnnl is None:
        raise KernelUnavailable(
            f"oneDNN's headers and library are not under {sys.prefix} "
            "(pip install onednn-cpu-gomp onednn-devel-cpu-gomp)"
        )
    path = library_path(cache_dir, dnnl)
    if not path.exists():
        args = [*FLAGS, f"-I{dnnl.include}", str(SOURCE), f"-L{dnnl.lib}", "-ldnnl", f"-Wl,-rpath,{dnnl.lib}"]
        compile_library(path, args)
    return Library(path)


class Gemm:
    """``y = x W^T + b`` for one fp32 weight ``[out, in]``, packed once into oneDNN's layout for this CPU."""

    def __init__(self, lib: Library, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        handle, size = _P(), _I()
        lib.new(self.out_features, self.in_features, ctypes.byref(handle), ctypes.byref(size))
        self.handle = handle.value
        self.packed = torch.empty(-(-size.value // 4), dtype=torch.float32)
        lib.pack(self.handle, weight.detach().contiguous().data_ptr(), self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous() or rows.dtype != torch.float32:
            rows = rows.to(torch.float32).contiguous()
        y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        if m := rows.shape[0]:
            self.lib.run(self.handle, rows.data_ptr(), self.packed.data_ptr(), self._bias_ptr, y.data_ptr(), m)
        return y.view(*lead, self.out_features)

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle:
            self.lib.free(handle)
