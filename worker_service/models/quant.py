"""Weights kept in GGUF's block formats, and weight-only int8 at load (`--quantization int8`).

A `BlockWeight` is a Linear's weight as ggml stores it: each row K / 32 blocks of 32
weights with a half scale d (and, for Q4_1 and Q5_1, a half offset m): Q4_0 and Q4_1 (4-bit),
Q5_0 and Q5_1 (5-bit), Q8_0 (8-bit); or K / 256 super-blocks of the K-quants Q4_K, Q5_K and
Q6_K (groups of 32 or 16 weights with 6- or 8-bit scales; block_formats.py). GGUF files are served in their own blocks (worker_service/gguf.py);
`--quantization int8` quantizes a float checkpoint to Q8_0 at load: symmetric, one scale per
32 weights of a row (finer than one per row: on the default model, whose weights come from
a Q4_1 file, per-row int8 costs 1.6% perplexity, Q8_0 blocks well under 1%).

The GEMM (`cpu_ops.gemm_gguf`) reads the blocks: 1.06 (Q8_0), 0.82 (Q6_K), 0.69-0.75 (Q5)
or 0.56-0.63 (Q4) bytes a weight, where bf16 reads two and AVX2's float32 GEMMs four. A bf16
model's activations are quantized to int8 per 32 values for integer dot products, as
llama.cpp does (gguf_q8.h, for Q4_0, Q4_1 and Q8_0: the fast default; on AVX512-VNNI CPUs
these three with each 16 rows interleaved: RowsWeight); otherwise, and for a
float32 model, they stay float32 and the weights are widened in registers (gguf_gemm.h: the
exact path, which the parity tests run). Without the C++ ops (no compiler, not a CPU) the
weight is dequantized
per call: correct, not fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_service.models import block_formats, cpu_ops
from worker_service.models.cpu_ops import CpuOps

BLOCK = 32  # weights per block (of Q4_0 ... Q8_0; K-quants: per group of a super-block)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14  # ggml type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}
BLOCK_SIZE = {t: 256 if t in (Q4_K, Q5_K, Q6_K) else BLOCK for t in BLOCK_BYTES}  # weights
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
              Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}  # fmt: skip
NATIVE = (torch.float32, torch.bfloat16)  # activation dtypes of the C++ GEMM
# Q4_0, Q4_1 and Q8_0 with each 16 weight rows interleaved (RowsWeight; gguf_q8_rows.h):
# Tessera's ids for the C++ GEMM, not ggml types.
ROWS = 16
ROWS_TYPES = {Q4_0: 1002, Q4_1: 1003, Q8_0: 1008}


@dataclass
class BlockWeight:
    """A Linear's weight [out, in] as rows of GGUF blocks."""

    blocks: torch.Tensor  # [out, in / BLOCK_SIZE * BLOCK_BYTES[ggml_type]] uint8
    ggml_type: int
    in_features: int
    ops: CpuOps | None  # the C++ GEMM, where it runs

    def __post_init__(self) -> None:
        if self.ggml_type not in BLOCK_BYTES:
            raise ValueError(f"ggml type {self.ggml_type} is not a block format Tessera reads")
        size, name = BLOCK_SIZE[self.ggml_type], TYPE_NAMES[self.ggml_type]
        if self.in_features % size:
            raise ValueError(
                f"{self.in_features} input features are not whole {name} blocks of {size}"
            )
        row_bytes = self.in_features // size * BLOCK_BYTES[self.ggml_type]
        if self.blocks.dtype != torch.uint8 or self.blocks.shape[1:] != (row_bytes,):
            raise ValueError(f"blocks {tuple(self.blocks.shape)} are not rows of {row_bytes} bytes")
        self.blocks = self.blocks.contiguous()
        if self.blocks.device.type != "cpu":
            self.ops = None

    @classmethod
    def quantize_q8_0(cls, weight: torch.Tensor, ops: CpuOps | None) -> BlockWeight:
        """[out, in] float weight -> Q8_0: d = max |w| / 127 per block, q = round(w / d)."""
        w = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)  # [out, blocks, 32]
        d = (w.abs().amax(dim=2, keepdim=True) / 127.0).half()
        safe = torch.where(d == 0, torch.ones_like(d), d).float()
        q = torch.round(w / safe).clamp_(-127, 127).to(torch.int8)
        raw = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=2)  # [out, blocks, 34]
        return cls(raw.reshape(weight.shape[0], -1), Q8_0, weight.shape[1], ops)

    @property
    def native_type(self) -> int:
        """The layout's id for the C++ GEMM: the ggml type, as the file stores it."""
        return self.ggml_type

    @property
    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        """Activation dtypes the C++ GEMM takes for this layout."""
        return NATIVE

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in `dtype`: the values the GEMM multiplies by."""
        return dequantize_blocks(self.blocks, self.ggml_type).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [n] -> rows [n, in] of `dequantize(dtype)`, only those read (an embedding's
        lookup). The blocks' own layout: RowsWeight interleaves its rows."""
        if self.ops is not None and dtype in NATIVE:
            return self.ops.dequantize_rows(
                self.blocks, self.ggml_type, self.in_features, ids, dtype
            )
        return dequantize_blocks(self.blocks.index_select(0, ids), self.ggml_type).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[n, in] -> [n, out] in x's dtype."""
        if self.blocks.is_cuda:  # the Triton dequant GEMM (models/quant_triton.py)
            from worker_service.models.quant_triton import block_linear

            return block_linear(x, self.blocks, self.ggml_type, bias)
        native = x.dtype in self.native_dtypes
        if self.ops is not None and x.dim() == 2 and x.shape[0] > 0 and native:
            path = cpu_ops.FAST if x.dtype == torch.bfloat16 else cpu_ops.EXACT
            return self.ops.gemm_gguf(x, self.blocks, self.native_type, bias, path)
        return F.linear(x, self.dequantize(x.dtype), bias)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


class RowsWeight(BlockWeight):
    """Q4_0, Q4_1 or Q8_0 blocks with each 16 weight rows interleaved (the same bytes:
    `interleave`), for the GEMM of gguf_q8_rows.h (AVX512-VNNI: every format, many rows on
    AMX tiles: amx_q8_rows.h; AVX2: Q4_0 and Q4_1), which takes bf16 activations only. A bf16
    model's weights in these formats take this layout at load where that GEMM runs
    (`for_bf16`): default model's GEMMs at 32 rows, 2 threads, Zen 5, 0.64x (Q4_1) and 0.66x
    (Q8_0) the time of oneDNN's bf16 GEMM, where the blocks' own path takes 1.04x and 1.10x;
    on an AMX Xeon 0.75x the blocks' own path's time at 32 rows; AVX2 Zen 3, default model's
    Q4_1 GGUF decode, 1.06-1.16x the blocks' tokens/s at batch 1, 1.13-1.20x at batch 32."""

    @property
    def native_type(self) -> int:
        return ROWS_TYPES[self.ggml_type]

    @property
    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16,)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        blocks = deinterleave(self.blocks, self.ggml_type)
        return dequantize_blocks(blocks, self.ggml_type).to(dtype)


def for_bf16(weight: BlockWeight) -> BlockWeight:
    """`weight` for a bf16 model's GEMMs: a plain Q4_0, Q4_1 or Q8_0 weight on CPU whose rows
    are whole 16s as a RowsWeight where this build has its GEMM, else `weight` as it is."""
    ops = weight.ops
    if type(weight) is not BlockWeight or weight.ggml_type not in ROWS_TYPES or ops is None:
        return weight
    if weight.blocks.shape[0] % ROWS or weight.blocks.device.type != "cpu":
        return weight
    if not ops.q8_rows(ROWS_TYPES[weight.ggml_type]):
        return weight
    blocks = interleave(weight.blocks, weight.ggml_type)
    return RowsWeight(blocks, weight.ggml_type, weight.in_features, ops)


def interleave(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """[out, blocks * bytes] rows of Q4_0, Q4_1 or Q8_0 blocks -> the same shape in
    gguf_q8_rows.h's layout: for each 16 rows g and block b, the 16 rows' half scales d (then
    their offsets m), then their values: Q8_0's q + 128 as [8 (4 K values)][16 rows][4];
    Q4's nibbles as [4][16 rows][4 bytes], byte e of a row holding values 8 p + e (low) and
    8 p + 4 + e (high)."""
    groups, size = blocks.shape[0] // ROWS, BLOCK_BYTES[ggml_type]
    raw = blocks.reshape(groups, ROWS, -1, size)  # [g, r, b, bytes]
    head = 2 if ggml_type == Q8_0 else size - BLOCK // 2  # bytes of scales a block
    scales = raw[..., :head].reshape(groups, ROWS, -1, head // 2, 2).permute(0, 2, 3, 1, 4)
    q = _values(raw[..., head:], ggml_type)  # [g, r, b, 32] unsigned
    if ggml_type == Q8_0:
        packed = q.reshape(groups, ROWS, -1, 8, 4)  # [g, r, b, 4 K values j, 4]
    else:
        pairs = q.reshape(groups, ROWS, -1, 4, 2, 4)  # [g, r, b, p, low / high, e]
        packed = pairs[..., 0, :] | (pairs[..., 1, :] << 4)  # [g, r, b, p, 4]
    values = packed.permute(0, 2, 3, 1, 4).reshape(groups, scales.shape[1], -1)
    return torch.cat([scales.reshape(*values.shape[:2], -1), values], 2).reshape(blocks.shape)


def deinterleave(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """`interleave` undone: the blocks as ggml stores them."""
    groups, size = blocks.shape[0] // ROWS, BLOCK_BYTES[ggml_type]
    raw = blocks.reshape(groups, -1, size * ROWS)  # [g, b, 16 blocks' bytes]
    count, head = raw.shape[1], 2 if ggml_type == Q8_0 else size - BLOCK // 2
    scales = raw[..., : head * ROWS].reshape(groups, count, head // 2, ROWS, 2)
    scales = scales.permute(0, 3, 1, 2, 4).reshape(groups, ROWS, count, head)  # [g, r, b, head]
    if ggml_type == Q8_0:
        q = _values(raw[..., head * ROWS :], ggml_type)  # ^ 0x80 is its own inverse
        q = q.reshape(groups, count, 8, ROWS, 4).permute(0, 3, 1, 2, 4)
    else:
        packed = raw[..., head * ROWS :].reshape(groups, count, 4, ROWS, 4).permute(0, 3, 1, 2, 4)
        low, high = packed & 15, packed >> 4  # [g, r, b, p, e]: values 8 p + e, 8 p + 4 + e
        values = torch.stack([low, high], dim=4).reshape(groups, ROWS, count, BLOCK)
        q = values[..., : BLOCK // 2] | (values[..., BLOCK // 2 :] << 4)  # ggml's nibbles
    q = q.reshape(groups, ROWS, count, -1)
    return torch.cat([scales, q], dim=3).reshape(blocks.shape)


def _values(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """[..., bytes of values] of Q4_0, Q4_1 or Q8_0 blocks -> [..., 32] uint8 values: Q8_0's
    q + 128, Q4's nibbles (byte j: value j low, j + 16 high)."""
    if ggml_type == Q8_0:
        return raw ^ 0x80
    return torch.cat([raw & 15, raw >> 4], dim=-1)


def dequantize_blocks(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """[rows, blocks * BLOCK_BYTES] uint8 -> [rows, blocks * BLOCK_SIZE] float32, as ggml
    dequantizes."""
    rows, nblocks = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES[ggml_type]
    raw = blocks.reshape(rows, nblocks, BLOCK_BYTES[ggml_type])  # [rows, blocks, bytes]
    width = nblocks * BLOCK_SIZE[ggml_type]
    if ggml_type in block_formats.DEQUANTIZE:
        return block_formats.DEQUANTIZE[ggml_type](raw).reshape(rows, width)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()  # [rows, blocks, 1]
    if ggml_type == Q8_0:
        q = raw[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, width)
    offset = 2 if ggml_type == Q4_0 else 4
    qs = raw[..., offset : offset + 16]
    q = _values(qs, ggml_type).float()  # value j: low nibble, j + 16: high
    if ggml_type == Q4_0:
        return (d * (q - 8)).reshape(rows, width)
    m = raw[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(rows, width)


def quantize_linears(model: torch.nn.Module, method: str) -> int:
    """Quantize every Linear of `model` (`method`: ModelConfig.quantization); how many."""
    from worker_service.models.layers import Linear  # layers imports this module

    if method != "int8":
        return 0
    linears = [
        m for m in model.modules()
        if isinstance(m, Linear) and m.quant is None and m.in_features % BLOCK == 0
    ]  # fmt: skip
    for linear in linears:
        linear.quantize()
    return len(linears)
