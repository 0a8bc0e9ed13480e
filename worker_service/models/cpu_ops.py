"""Fused elementwise ops for CPUs (`cpu_ops.cpp`): RMSNorm + residual, RoPE, SiLU * up,
the sampler's grammar bitmask and greedy pick, and the GEMMs bound by reading the weight
(`small_gemm.h`): a few rows over bf16 weights, any rows over GGUF's blocks and super-blocks
(`gguf_gemm.h`).

At small batches a decode step is dominated by the dispatch of many tiny torch ops;
each of these replaces 3-8 of them with one ctypes call that keeps HF's bf16 rounding
order. `load()` returns None (and logs why, once) where the library cannot be built;
the layers then keep their torch code.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from worker_service import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_SIGNATURES: dict[str, list[Any]] = {
    # dtype, x, residual, weight, out, n, hidden, eps, num_threads
    "tessera_add_rms_norm": [
        ctypes.c_int, *[ctypes.c_void_p] * 4, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
        ctypes.c_int,
    ],
    # dtype, qk, n, heads, head_dim, row_stride, cos, sin, num_threads
    "tessera_rope": [
        ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int,
    ],
    # dtype, gate_up, out, n, inter, num_threads
    "tessera_silu_mul": [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int,
    ],
    # logits, vocab, rows, bitmask, n, words, num_threads
    "tessera_apply_bitmask": [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int,
    ],
    # x, rows, vocab, out, num_threads
    "tessera_argmax_rows": [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
    ],
    # x, w, bias, out, rows, K, N, num_threads
    "tessera_gemm_bf16": [*[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 3, ctypes.c_int],
    "tessera_amx_enable": [],
    "tessera_q8_rows": [ctypes.c_int],  # a rows layout's id
    # x, packed, bias, out, rows, K, N, num_threads
    "tessera_gemm_amx": [*[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 3, ctypes.c_int],
    # x, packed, bias, out, rows, K, I, num_threads
    "tessera_gemm_amx_gated": [*[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 3, ctypes.c_int],
    # type, dtype, x, w, bias, out, rows, K, N, path, num_threads
    "tessera_gemm_gguf": [
        ctypes.c_int, ctypes.c_int, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 3, ctypes.c_int,
        ctypes.c_int,
    ],
    # type, dtype, w, rows, ids, n, K, out
    "tessera_dequantize_rows": [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
    ],
}  # fmt: skip
# Up to this many rows the bf16 GEMM beats oneDNN's float32 one over an upcast copy (AVX2).
SMALL_GEMM_ROWS = 8
# From this many rows a bf16 Linear on AMX CPUs runs oneDNN's brgemm over its plain weight
# (kept beside the tiles' copy) instead of gemm_amx: 2048 rows of the default model's layer
# GEMMs took 172-215 ms there against 230-404 ms; at 512 rows the two are even.
AMX_ONEDNN_ROWS = 1024
EXACT, INT8, FAST = 0, 1, 2  # gemm_gguf's paths (gguf_q8.h: Path)
AMX_GGUF_ROWS = 6  # from this many rows FAST takes the AMX tiles (gguf_q8.h: kAmxRows)
# ... and over quant.ROWS_TYPES' layouts, per ggml type (amx_q8_rows.h: kMinRows)
ROWS_TILE_ROWS = {2: 20, 3: 20, 8: 28}  # Q4_0, Q4_1, Q8_0
# Without tiles, from this many rows FAST takes bf16 panels with AVX512-BF16 dots (kBf16Rows)
BF16_GGUF_ROWS = 8
# for Q4_0 and Q4_1 (int8 x 16 weight rows a pass: gguf_q8.h, kWideBf16Rows)
WIDE_GGUF_ROWS = 24
# and from this many the panels take the Quads layout (gguf_dots.h: kQuadRows)
QUAD_GGUF_ROWS = 32


@functools.cache
def load() -> CpuOps | None:
    """The fused ops, or None when this machine cannot build them."""
    try:
        return build()
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("fused CPU ops unavailable (%s); using torch ops", exc)
        return None


def build(level: str | None = None) -> CpuOps:
    """The ops built for `level` (native.compile_flags; default this CPU's). Raises where
    they cannot be built."""
    lib = native.build(SOURCE, level)
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    return CpuOps(lib)


def _check(status: int, op: str) -> None:
    if status:
        raise ValueError(f"fused CPU op {op} rejected its arguments (status {status})")


class CpuOps:
    """The library's ops over torch tensors (CPU, float32 or bf16, contiguous rows)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [n, hidden]
        residual: torch.Tensor | None,  # [n, hidden]; updated in place to x + residual
        weight: torch.Tensor,  # [hidden]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rms_norm(x + residual), x + residual), as RMSNorm.forward."""
        x = x.contiguous()
        out = torch.empty_like(x)
        src, res = (None, x) if residual is None else (x, residual)
        assert res.is_contiguous() and res.dtype == x.dtype == weight.dtype
        status = self.lib.tessera_add_rms_norm(
            DTYPES[x.dtype], None if src is None else src.data_ptr(), res.data_ptr(),
            weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
            torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "add_rms_norm")
        return out, res

    def rope_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate qk [n, heads, head_dim] in place (rows may be strided); cos, sin
        [n, 1, head_dim // 2] in qk's dtype, as RotaryEmbedding.lookup returns them."""
        n, heads, head_dim = qk.shape
        assert qk.stride(2) == 1 and qk.stride(1) == head_dim and qk.dtype == cos.dtype
        assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[0] == n
        status = self.lib.tessera_rope(
            DTYPES[qk.dtype], qk.data_ptr(), n, heads, head_dim, qk.stride(0), cos.data_ptr(),
            sin.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "rope")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2 * inter] (gate, up) -> silu(gate) * up [n, inter]."""
        assert gate_up.is_contiguous()
        n, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(n, inter)
        status = self.lib.tessera_silu_mul(
            DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), n, inter,
            torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "silu_mul")
        return out

    def apply_bitmask(
        self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
    ) -> None:
        """-inf on logits [B, V] float32 where the rows' bitmask [n, W] int32 has a 0 bit."""
        assert logits.is_contiguous() and logits.dtype == torch.float32
        rows = rows.to(torch.int64).contiguous()
        bitmask = bitmask.contiguous()
        assert bitmask.dtype == torch.int32 and rows.shape[0] == bitmask.shape[0]
        status = self.lib.tessera_apply_bitmask(
            logits.data_ptr(), logits.shape[1], rows.data_ptr(), bitmask.data_ptr(),
            bitmask.shape[0], bitmask.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "apply_bitmask")

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, V] float32 -> [B] int64 index of each row's first maximum (first NaN where a
        row has one), as torch's max(dim=-1).indices; several times faster at a vocabulary."""
        assert x.is_contiguous() and x.dtype == torch.float32 and x.dim() == 2
        out = torch.empty(x.shape[0], dtype=torch.int64)
        status = self.lib.tessera_argmax_rows(
            x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
        )
        _check(status, "argmax_rows")
        return out

    def gemm_bf16(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [rows, K] @ weight [N, K].T + bias [N] -> [rows, N], all bf16, summed in
        float32 (F.linear's result up to the order of the sums); for rows <= SMALL_GEMM_ROWS."""
        x = x.contiguous()
        assert x.dtype == weight.dtype == torch.bfloat16 and weight.is_contiguous()
        assert bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
        out = x.new_empty(x.shape[0], weight.shape[0])
        status = self.lib.tessera_gemm_bf16(
            x.data_ptr(), weight.data_ptr(), _ptr(bias), out.data_ptr(), x.shape[0],
            x.shape[1], weight.shape[0], torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "gemm_bf16")
        return out

    @functools.cached_property
    def amx(self) -> bool:
        """Whether gemm_amx runs here: this build has it (AVX512_BF16), the CPU has AMX tiles
        for bf16, and the kernel lends them to this process."""
        return native.amx_bf16_cpu() and self.lib.tessera_amx_enable() == 0

    def q8_rows(self, layout: int) -> bool:
        """Whether gemm_gguf runs quant.RowsWeight's `layout` (a quant.ROWS_TYPES id) here:
        this build has its GEMM (AVX512-VNNI: every layout; AVX2: Q4_0 and Q4_1). Asks for
        the AMX tiles first: where the process has them, its FAST path takes them from
        ROWS_TILE_ROWS rows (amx_q8_rows.h)."""
        _ = self.amx
        return self.lib.tessera_q8_rows(layout) == 0

    def gemm_amx(
        self,
        x: torch.Tensor,  # [rows, K] bf16
        packed: torch.Tensor,  # pack_amx(weight [N, K])
        bias: torch.Tensor | None,  # [N] bf16
        n: int,  # N
    ) -> torch.Tensor:
        """x @ weight.T + bias -> [rows, N] bf16 on AMX tiles, summed in float32."""
        x = x.contiguous()
        assert x.dtype == packed.dtype == torch.bfloat16 and packed.is_contiguous()
        assert bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
        out = x.new_empty(x.shape[0], n)
        status = self.lib.tessera_gemm_amx(
            x.data_ptr(), packed.data_ptr(), _ptr(bias), out.data_ptr(), x.shape[0],
            x.shape[1], n, torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "gemm_amx")
        return out

    def gemm_amx_gated(
        self,
        x: torch.Tensor,  # [rows, K] bf16
        packed: torch.Tensor,  # pack_amx(gate_up weight [2 I, K]): gate's rows, then up's
        bias: torch.Tensor | None,  # [2 I] bf16
        inter: int,  # I, a multiple of 16
    ) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) -> [rows, I] bf16: gemm_amx then silu_mul, to the bit,
        in one pass (amx_gemm.h: gemm_gated)."""
        x = x.contiguous()
        assert x.dtype == packed.dtype == torch.bfloat16 and packed.is_contiguous()
        assert bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
        out = x.new_empty(x.shape[0], inter)
        status = self.lib.tessera_gemm_amx_gated(
            x.data_ptr(), packed.data_ptr(), _ptr(bias), out.data_ptr(), x.shape[0],
            x.shape[1], inter, torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "gemm_amx_gated")
        return out

    def gemm_gguf(
        self,
        x: torch.Tensor,  # [rows, K] float32 or bf16
        blocks: torch.Tensor,  # [N, K / block size * block bytes] uint8: GGUF blocks
        ggml_type: int,  # quant.TYPE_NAMES: Q4_0 (2) ... Q8_0 (8), Q4_K (12) ... Q6_K (14)
        bias: torch.Tensor | None,  # [N] in x's dtype
        path: int = EXACT,
    ) -> torch.Tensor:
        """x @ dequantize(blocks).T + bias -> [rows, N] in x's dtype, summed in float32.
        path EXACT: x stays float32. INT8: x quantized to int8 per 32 values for integer dot
        products (gguf_q8.h), where this build has them (AVX2) and the format does. FAST (bf16
        x): from AMX_GGUF_ROWS rows on AMX CPUs, the blocks dequantized to bf16 a
        panel at a time for the tiles (amx_gguf.h; quant.ROWS_TYPES' layouts from
        ROWS_TILE_ROWS rows: amx_q8_rows.h); else INT8."""
        if path == FAST and x.dtype == torch.bfloat16:
            _ = self.amx  # asks for the tiles (once): the C++ GEMM takes them from then on
        x = x.contiguous()
        assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
        assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous())
        out = x.new_empty(x.shape[0], blocks.shape[0])
        status = self.lib.tessera_gemm_gguf(
            ggml_type, DTYPES[x.dtype], x.data_ptr(), blocks.data_ptr(), _ptr(bias),
            out.data_ptr(), x.shape[0], x.shape[1], blocks.shape[0], path,
            torch.get_num_threads(),
        )  # fmt: skip
        if status == 2:
            raise ValueError(
                f"fused CPU op gemm_gguf: K={x.shape[1]} is not a whole number of blocks of "
                f"ggml type {ggml_type} (32 weights; 256 for the K-quants)"
            )
        _check(status, "gemm_gguf")
        return out

    def dequantize_rows(
        self,
        blocks: torch.Tensor,  # [N, K / block size * block bytes] uint8: GGUF blocks
        ggml_type: int,
        k: int,  # weights a row
        ids: torch.Tensor,  # [n] int64 in [0, N)
        dtype: torch.dtype,  # float32 or bf16
    ) -> torch.Tensor:
        """Rows `ids` of dequantize(blocks) -> [n, K] in `dtype` (an embedding's lookup)."""
        assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], k, dtype=dtype)
        status = self.lib.tessera_dequantize_rows(
            ggml_type, DTYPES[dtype], blocks.data_ptr(), blocks.shape[0], ids.data_ptr(),
            ids.shape[0], k, out.data_ptr(),
        )  # fmt: skip
        if status == 4:
            raise IndexError(f"row ids outside the {blocks.shape[0]} rows of the blocks")
        _check(status, "dequantize_rows")
        return out


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (K a multiple of 32) -> amx_gemm.h's tile layout
    [ceil(N / 16), K / 32, 16, 16, 2]: 16 output columns by 32 K values a tile, in pairs."""
    n, k = weight.shape
    assert weight.dtype == torch.bfloat16 and k % 32 == 0
    padded = F.pad(weight, (0, 0, 0, -n % 16))  # [N padded to 16, K]
    tiles = padded.view(padded.shape[0] // 16, 16, k // 32, 16, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
