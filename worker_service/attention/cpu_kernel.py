"""The CPU paged decode-attention kernel (`cpu_decode.cpp`), built at first use.

The source is built by `worker_service.native` (once per source, flags and CPU
level, into Tessera's cache directory) and loaded through ctypes; the call
releases the GIL and runs on torch's intra-op thread count. `load()` returns None
(and logs why, once) where it cannot be built; the backend then keeps its SDPA path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker_service import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Quantized pools the kernel reads (kv_quant): the cache_dtype codes; 0 = the query's dtype.
CACHE_DTYPES = {torch.int8: 2, torch.float8_e4m3fn: 3}

_ARGTYPES: list[Any] = [
    ctypes.c_int,  # dtype
    ctypes.c_int,  # cache_dtype
    *[ctypes.c_void_p] * 5,  # query, k_cache, v_cache, out, block_table
    ctypes.c_int64,  # table_stride
    *[ctypes.c_void_p] * 3,  # seq_lens, reqs, rows
    *[ctypes.c_int64] * 7,  # num_decode, heads, kv_heads, head_dim, block_size, window, split
    ctypes.c_float,  # scale
    ctypes.c_int,  # num_threads
]
_SCATTER_ARGTYPES: list[Any] = [
    ctypes.c_void_p, ctypes.c_int64,  # src, src_stride (bytes)
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # dst, row_bytes, num_slots
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # slots, n, num_threads
]  # fmt: skip
_PREFILL_ARGTYPES: list[Any] = [
    ctypes.c_int,  # cache_dtype
    *[ctypes.c_void_p] * 5,  # query, k_cache, v_cache, out, blocks
    *[ctypes.c_int64] * 6,  # query_len, seq_len, heads, kv_heads, head_dim, block_size
    ctypes.c_float,  # scale
    ctypes.c_int,  # num_threads
]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel library, or None when this machine cannot build it."""
    try:
        return build()
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("CPU decode kernel unavailable (%s); using SDPA for decode", exc)
        return None


def build(level: str | None = None) -> ctypes.CDLL:
    """The kernel built for CPU `level` (native.compile_flags; None: this CPU's), typed."""
    lib = native.build(SOURCE, level)
    lib.tessera_paged_decode.argtypes = _ARGTYPES
    lib.tessera_paged_decode.restype = ctypes.c_int
    lib.tessera_paged_prefill.argtypes = _PREFILL_ARGTYPES
    lib.tessera_paged_prefill.restype = ctypes.c_int
    lib.tessera_prefill_engine.argtypes = [ctypes.c_int]
    lib.tessera_prefill_engine.restype = ctypes.c_int
    choose_prefill_engine(lib, "tiles")  # the default: AMX tiles where the CPU has them
    lib.tessera_scatter_rows.argtypes = _SCATTER_ARGTYPES
    lib.tessera_scatter_rows.restype = ctypes.c_int
    return lib


def rows_apart(x: torch.Tensor) -> bool:
    """Whether each row of x [n, ...] is one contiguous span (what scatter_rows takes; K and
    V are such views of the qkv GEMM's output)."""
    return x[:1].is_contiguous()  # (a dimension of size 1 has any stride)


def scatter_rows(
    lib: ctypes.CDLL, rows: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor
) -> None:
    """pool[slots[i]] = rows[i]: rows [n, ...] with each row contiguous (rows may be strided,
    e.g. K's columns of the qkv GEMM's output), pool [num_slots, ...] contiguous, of one dtype;
    slots [n] int64 (index_copy_'s job, without its cost; IndexError, as it, for a slot out of
    range, and nothing written)."""
    assert rows.dtype == pool.dtype and pool.is_contiguous() and slots.dtype == torch.int64
    assert rows_apart(rows) and rows.shape[1:] == pool.shape[1:] and slots.is_contiguous()
    row_bytes = pool[0].numel() * pool.element_size()
    status = lib.tessera_scatter_rows(
        rows.data_ptr(), rows.stride(0) * rows.element_size(), pool.data_ptr(), row_bytes,
        pool.shape[0], slots.data_ptr(), slots.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise IndexError(f"a KV slot outside the pool of {pool.shape[0]} slots")


PREFILL_ENGINES = {"tiles": 1, "dots": 2}  # cpu_decode.cpp: tessera_prefill_engine


def prefill_engine(lib: ctypes.CDLL) -> str | None:
    """The engine `paged_prefill` runs on: "tiles" (AMX), "dots" (AVX512-BF16 dot products) or
    None (prefills stay on SDPA). The library starts on the tiles where the CPU has them."""
    names = {code: name for name, code in PREFILL_ENGINES.items()}
    return names.get(lib.tessera_prefill_engine(-1))


def choose_prefill_engine(lib: ctypes.CDLL, name: str | None) -> str | None:
    """Runs `paged_prefill` on engine `name` (None: no engine, SDPA) from now on, where this
    build and CPU have it; returns the engine then running.

    The dots engine is not chosen by default. It is as accurate as SDPA (error to a float64
    reference: max 0.0077 both) and 3-6x faster, but the default model's bf16 answer to the
    chat question the tests and demos ask ("What is the capital of France?") sits on a knife
    edge (HF float32: "The" 25.33 vs "L" 25.24), and under the dots engine it falls to "L'Étoile,
    ..." on Zen 4. Tests choose it to check it."""
    if name == "tiles" and not native.amx_bf16_cpu():
        name = None
    lib.tessera_prefill_engine(PREFILL_ENGINES.get(name or "", 0))
    return prefill_engine(lib)


@dataclass(frozen=True)
class DecodeBatch:
    """One step's decode requests, checked once and shared by every layer's call."""

    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    reqs: torch.Tensor  # [num_decode] int64: the decode requests
    rows: torch.Tensor  # [num_decode] int64: their token rows
    # KV splits: 0 adaptive (more when the step has few rows: faster, but a row's bits depend
    # on the step); > 0 one split per split_tokens of a row's own KV (batch-invariant mode).
    split_tokens: int = 0

    def __post_init__(self) -> None:
        for t in (self.block_table, self.seq_lens, self.reqs, self.rows):
            assert t.is_contiguous() and t.device.type == "cpu"
        assert self.block_table.dtype == self.seq_lens.dtype == torch.int32
        assert self.reqs.dtype == self.rows.dtype == torch.int64
        assert self.split_tokens >= 0


def paged_decode(
    lib: ctypes.CDLL,
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim (+ 2 quantized)]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, heads, head_dim], written at `batch.rows`
    batch: DecodeBatch,
    scale: float,
    window: int = 0,
) -> None:
    """out[rows[i]] = attention of query[rows[i]] over request reqs[i]'s cached K/V (its last
    `window` tokens with a sliding window; 0: all). The pools are in the query's dtype or
    quantized (CACHE_DTYPES, values and scales per slot's head row)."""
    for t in (query, k_cache, v_cache, out):
        assert t.is_contiguous() and t.device.type == "cpu"
    assert out.dtype == query.dtype and k_cache.dtype == v_cache.dtype
    cache_dtype = 0 if k_cache.dtype == query.dtype else CACHE_DTYPES[k_cache.dtype]
    _, block_size, kv_heads, _ = k_cache.shape
    head_dim = query.shape[2]
    b = batch
    status = lib.tessera_paged_decode(
        DTYPES[query.dtype], cache_dtype,
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        b.block_table.data_ptr(), b.block_table.shape[1], b.seq_lens.data_ptr(),
        b.reqs.data_ptr(), b.rows.data_ptr(), b.reqs.shape[0],
        query.shape[1], kv_heads, head_dim, block_size, window, b.split_tokens, scale,
        torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"paged decode kernel rejected its arguments (status {status})")


def paged_prefill(
    lib: ctypes.CDLL,
    query: torch.Tensor,  # [query_len, heads, head_dim] bf16: one request's new rows
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim (+ 2 quantized)]
    v_cache: torch.Tensor,
    blocks: torch.Tensor,  # [ceil(seq_len / block_size)] int32: the request's block ids
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """[query_len, heads, head_dim]: causal attention of the request's last query_len tokens
    over its seq_len cached ones (amx_prefill.h; on the engine prefill_engine chose). The pools
    are bf16 or quantized (CACHE_DTYPES), widened to bf16 as they are read."""
    for t in (query, k_cache, v_cache, blocks):
        assert t.is_contiguous() and t.device.type == "cpu"
    assert query.dtype == torch.bfloat16 and k_cache.dtype == v_cache.dtype
    assert blocks.dtype == torch.int32 and blocks.numel() * k_cache.shape[1] >= seq_len
    cache_dtype = 0 if k_cache.dtype == query.dtype else CACHE_DTYPES[k_cache.dtype]
    out = torch.empty_like(query)
    (query_len, heads, head_dim), (_, block_size, kv_heads, _) = query.shape, k_cache.shape
    status = lib.tessera_paged_prefill(
        cache_dtype, query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        blocks.data_ptr(), query_len, seq_len, heads, kv_heads, head_dim, block_size, scale,
        torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"paged prefill kernel rejected its arguments (status {status})")
    return out
