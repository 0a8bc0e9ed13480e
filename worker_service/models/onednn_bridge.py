"""oneDNN's packed GEMM as a native callback (`onednn_bridge.cpp`), for the fused decode step.

The fused decode step (fused_decode.py) runs every decoder layer in one native call, so that a
step pays no Python dispatch per op. Its own dense GEMM (small_gemm.h) wins only up to a few
rows; from there it calls back into oneDNN through this library, over the weight that
`layers.Linear.pack` packed for the layers' path (shared, not copied), so both paths run the
same GEMM. The library is built against the running torch (its headers, libtorch_cpu and
c10); `load()` returns None (and logs why, once) where it cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from worker_service import native
from worker_service.models.cpu_ops import DTYPES
from worker_service.models.layers import Linear

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("onednn_bridge.cpp")


def torch_flags() -> list[str]:
    """Compiler flags to build against this process's torch (the version joins the build's
    digest, so a new torch rebuilds the library)."""
    root = Path(torch.__file__).parent
    return [
        "-std=c++20",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        f'-DTESSERA_TORCH_VERSION="{torch.__version__}"',
        f"-I{root / 'include'}",
        f"-L{root / 'lib'}",
        f"-Wl,-rpath,{root / 'lib'}",
        "-ltorch_cpu",
        "-lc10",
    ]


@functools.cache
def load() -> OnednnBridge | None:
    """The bridge, or None where this machine cannot build it (or torch has no oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return OnednnBridge(native.build(SOURCE, "", torch_flags()))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("oneDNN bridge unavailable (%s); fused decode steps stay small", exc)
        return None


class OnednnGemm:
    """One Linear's packed GEMM as a callback context (`handle`), released with this object."""

    def __init__(self, lib: ctypes.CDLL, linear: Linear, dtype: torch.dtype) -> None:
        packed, bias = linear.packed, linear.packed_bias
        assert packed is not None
        self.lib = lib
        self.handle = lib.tessera_onednn_context(
            packed._cdata, 0 if bias is None else bias._cdata, linear.in_features,
            linear.out_features, DTYPES[dtype],
        )  # fmt: skip
        if not self.handle:
            raise OSError("tessera_onednn_context failed")

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.lib.tessera_onednn_release(self.handle)


class OnednnBridge:
    """The library: `gemm`, the callback's address (decode_layers.h: TesseraGemm), and
    `context(linear, dtype)` for each Linear it runs."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.tessera_onednn_context.argtypes = [*[ctypes.c_int64] * 4, ctypes.c_int]
        lib.tessera_onednn_context.restype = ctypes.c_void_p
        lib.tessera_onednn_release.argtypes = [ctypes.c_void_p]
        lib.tessera_onednn_release.restype = None
        lib.tessera_onednn_gemm.argtypes = [*[ctypes.c_void_p] * 3, ctypes.c_int64]
        lib.tessera_onednn_gemm.restype = ctypes.c_int
        gemm = ctypes.cast(lib.tessera_onednn_gemm, ctypes.c_void_p).value
        assert gemm is not None
        self.gemm: int = gemm

    def context(self, linear: Linear, dtype: torch.dtype) -> OnednnGemm:
        """A context for `linear`'s packed GEMM (linear.packed set) in a `dtype` model."""
        return OnednnGemm(self.lib, linear, dtype)
