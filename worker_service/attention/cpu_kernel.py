"""The CPU paged decode-attention kernel (`cpu_decode.cpp`), built at first use.

The source is compiled once per source, flags and CPU level with the system C++
compiler into Tessera's cache directory and loaded through ctypes; the call
releases the GIL and runs on torch's intra-op thread count. `load()` returns None
(and logs why, once) where it cannot be built; the backend then keeps its SDPA path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.default_model import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# torch's CPU capability -> the matching x86-64 level; elsewhere the compiler's default.
MARCH = {"AVX2": ["-march=x86-64-v3"], "AVX512": ["-march=x86-64-v4"]}
FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC"]
LIBS = ["-lmvec"]  # glibc's vector math (the softmax's expf)
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_ARGTYPES: list[Any] = [
    ctypes.c_int,  # dtype
    *[ctypes.c_void_p] * 5,  # query, k_cache, v_cache, out, block_table
    ctypes.c_int64,  # table_stride
    *[ctypes.c_void_p] * 3,  # seq_lens, reqs, rows
    *[ctypes.c_int64] * 5,  # num_decode, heads, kv_heads, head_dim, block_size
    ctypes.c_float,  # scale
    ctypes.c_int,  # num_threads
]


def compile_flags() -> list[str]:
    return [*FLAGS, *MARCH.get(torch.backends.cpu.get_cpu_capability(), []), *LIBS]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel library, or None when this machine cannot build it."""
    flags = compile_flags()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu_decode-{digest}.so"
    try:
        if not target.exists():
            _build(target, flags)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("CPU decode kernel unavailable (%s); using SDPA for decode", exc)
        return None
    lib.tessera_paged_decode.argtypes = _ARGTYPES
    lib.tessera_paged_decode.restype = ctypes.c_int
    return lib


def _build(target: Path, flags: list[str]) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, str(SOURCE), "-o", tmp, *flags], check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)  # atomic: concurrent builders each publish a whole file
    finally:
        Path(tmp).unlink(missing_ok=True)
    for stale in target.parent.glob("cpu_decode-*.so"):  # builds of older sources or flags
        if stale != target:
            stale.unlink(missing_ok=True)
    log.info("built the CPU decode kernel: %s", target)


@dataclass(frozen=True)
class DecodeBatch:
    """One step's decode requests, checked once and shared by every layer's call."""

    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    reqs: torch.Tensor  # [num_decode] int64: the decode requests
    rows: torch.Tensor  # [num_decode] int64: their token rows

    def __post_init__(self) -> None:
        for t in (self.block_table, self.seq_lens, self.reqs, self.rows):
            assert t.is_contiguous() and t.device.type == "cpu"
        assert self.block_table.dtype == self.seq_lens.dtype == torch.int32
        assert self.reqs.dtype == self.rows.dtype == torch.int64


def paged_decode(
    lib: ctypes.CDLL,
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, heads, head_dim], written at `batch.rows`
    batch: DecodeBatch,
    scale: float,
) -> None:
    """out[rows[i]] = attention of query[rows[i]] over request reqs[i]'s cached K/V."""
    for t in (query, k_cache, v_cache, out):
        assert t.is_contiguous() and t.device.type == "cpu" and t.dtype == query.dtype
    _, block_size, kv_heads, head_dim = k_cache.shape
    b = batch
    status = lib.tessera_paged_decode(
        DTYPES[query.dtype],
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        b.block_table.data_ptr(), b.block_table.shape[1], b.seq_lens.data_ptr(),
        b.reqs.data_ptr(), b.rows.data_ptr(), b.reqs.shape[0],
        query.shape[1], kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"paged decode kernel rejected its arguments (status {status})")
