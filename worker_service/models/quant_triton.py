"""Triton dequant-GEMM for GPU: out = x @ dequantize(blocks).T (+ bias), blocks kept packed.

One kernel for every GGUF block format (the format is a constexpr): a program owns a
BLOCK_M x BLOCK_N tile of `out` and walks K one scale group at a time (32 weights; 16 for
Q6_K). For each group it loads the group's bytes of BLOCK_N rows, decodes the integer
codes q (nibbles, int8, or Q6_K's 4 + 2 bits) in registers, and adds
    dot(x[:, group], q) * scale[n] + rowsum(x[:, group]) * offset[n]
to a float32 accumulator: w = scale * q + offset within a group, so the integer codes,
exact in fp16/bf16, go through the dot unrounded and the scales are applied afterwards
in float32 (dequantizing to bf16 first would round every weight to 8 bits of mantissa).

Formats (ggml's layouts; `quant.dequantize_blocks` / gguf.quants.dequantize are the
reference): Q4_0 {half d; u8 qs[16]} w = d (q - 8); Q4_1 {half d, m; qs[16]} w = d q + m;
Q8_0 {half d; i8 qs[32]} w = d q; (nibble j of a block is qs[j] & 15, j + 16 is qs[j] >> 4).
Q4_K (256 weights) {half d, dmin; u8 scales[12]; qs[128]}: 8 groups of 32 with 6-bit scale
and min, w = d sc q - dmin mn. Q6_K (256) {ql[128]; qh[64]; i8 scales[16]; half d}: 16
groups of 16, w = d sc (q - 32). Every block's size is even, so the halves are read through
a float16 view of the same bytes.

The main loop decodes K_CHUNK inputs (several groups, unrolled) an iteration so that
their loads are in flight together; a second loop takes the last K % K_CHUNK. Rows with
fewer than 16 activations (decode) take a broadcast-multiply-and-sum path (tl.dot needs
16 rows); more use tl.dot. Tested on CPU under TRITON_INTERPRET=1 and compiled for sm_90
without a GPU (tests/quant/test_quant_triton.py); checked and timed on CUDA by
benchmarks/gpu_check.py (section 3, benchmarks/gpu_check_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14  # ggml type ids
# ggml type -> (weights a block, bytes a block, weights a scale group)
LAYOUT = {
    Q4_0: (32, 18, 32),
    Q4_1: (32, 20, 32),
    Q8_0: (32, 34, 32),
    Q4_K: (256, 144, 32),
    Q6_K: (256, 210, 16),
}
DOT_MIN_ROWS = 16  # tl.dot's smallest M
K_CHUNK = 128  # inputs a main-loop iteration decodes (4 groups; Q6_K 8)
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _half(halves_ptr, byte_offset):
    """The float16 at an even byte offset, as float32."""
    return tl.load(halves_ptr + byte_offset // 2).to(tl.float32)


@triton.jit
def _q4k_scale_min(blocks_ptr, base, s):
    """Q4_K's 6-bit scale and min of group s (0..7) from the 12 bytes at base + 4."""
    lo = tl.load(blocks_ptr + base + 4 + s % 4).to(tl.int32)  # scales[s] when s < 4
    hi = tl.load(blocks_ptr + base + 4 + s % 4 + 4).to(tl.int32)  # scales[s + 4] or [s]
    top = tl.load(blocks_ptr + base + 4 + s % 4 + 8).to(tl.int32)  # scales[s + 4], s >= 4
    first = s < 4
    sc = tl.where(first, lo & 63, (top & 15) | ((lo >> 6) << 4))
    mn = tl.where(first, hi & 63, (top >> 4) | ((hi >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode_group(blocks_ptr, halves_ptr, row_base, k0, offs_g, FMT: tl.constexpr,
                  QK: tl.constexpr, BYTES: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """Group k0 // GROUP of rows row_base [BLOCK_N] (their byte offsets): the codes q
    [GROUP, BLOCK_N] (int32) and scale, offset [BLOCK_N] (float32), w = scale q + offset."""
    base = row_base + (k0 // QK) * BYTES  # [BLOCK_N] byte offset of the block
    j = offs_g[:, None]  # [GROUP, 1] position in the group
    pos = k0 % QK  # first position of the group in its block
    if FMT == 8:  # Q8_0
        q = tl.load(blocks_ptr + base[None, :] + 2 + j).to(tl.int8, bitcast=True).to(tl.int32)
        scale = _half(halves_ptr, base)
        offset = tl.zeros_like(scale)
    elif FMT == 12:  # Q4_K
        s = pos // 32
        packed = tl.load(blocks_ptr + base[None, :] + 16 + (s // 2) * 32 + j).to(tl.int32)
        q = (packed >> ((s % 2) * 4)) & 15
        sc, mn = _q4k_scale_min(blocks_ptr, base, s)
        scale = _half(halves_ptr, base) * sc
        offset = -_half(halves_ptr, base + 2) * mn
    elif FMT == 14:  # Q6_K
        half, quarter = pos // 128, (pos % 128) // 32
        lane = pos % 32 + j  # position within the 32-wide quarter
        low = tl.load(blocks_ptr + base[None, :] + half * 64 + (quarter % 2) * 32 + lane)
        high = tl.load(blocks_ptr + base[None, :] + 128 + half * 32 + lane)
        low = (low.to(tl.int32) >> ((quarter // 2) * 4)) & 15
        high = (high.to(tl.int32) >> (quarter * 2)) & 3
        q = (low | (high << 4)) - 32
        sc = tl.load(blocks_ptr + base + 192 + pos // 16).to(tl.int8, bitcast=True)
        scale = _half(halves_ptr, base + 208) * sc.to(tl.float32)
        offset = tl.zeros_like(scale)
    else:  # Q4_0 (2), Q4_1 (3): nibble j is qs[j] & 15, j + 16 is qs[j] >> 4
        qs = 2 if FMT == 2 else 4
        packed = tl.load(blocks_ptr + base[None, :] + qs + j % 16).to(tl.int32)
        q = (packed >> ((j // 16) * 4)) & 15
        scale = _half(halves_ptr, base)
        if FMT == 2:
            q -= 8
            offset = tl.zeros_like(scale)
        else:
            offset = _half(halves_ptr, base + 2)
    return q, scale, offset


@triton.jit
def _accumulate_group(acc, x_rows, m_ok, blocks_ptr, halves_ptr, row_base, k0,
                      FMT: tl.constexpr, QK: tl.constexpr, BYTES: tl.constexpr,
                      GROUP: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] + x[:, group] @ w[group, :] for the group at input k0."""
    offs_g = tl.arange(0, GROUP)
    q, scale, offset = _decode_group(
        blocks_ptr, halves_ptr, row_base, k0, offs_g, FMT, QK, BYTES, GROUP
    )  # q [GROUP, BLOCK_N]; scale, offset [BLOCK_N]
    x = tl.load(x_rows + k0 + offs_g[None, :], mask=m_ok[:, None], other=0.0)
    if USE_DOT:  # the codes are small integers: exact in any dot dtype
        part = tl.dot(x.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    else:
        part = tl.sum(x.to(tl.float32)[:, :, None] * q.to(tl.float32)[None, :, :], axis=1)
    acc += part * scale[None, :]
    if FMT == 3 or FMT == 12:  # formats with an offset: + offset * sum(x)
        acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * offset[None, :]
    return acc


@triton.jit
def _dequant_gemm_kernel(
    x_ptr,  # [M, K] fp16 / bf16 / fp32
    blocks_ptr,  # [N, row_bytes] uint8
    halves_ptr,  # the same bytes as float16
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] x's dtype
    M,
    N,
    K,
    row_bytes,
    stride_xm,
    stride_om,
    FMT: tl.constexpr,
    QK: tl.constexpr,  # weights a block
    BYTES: tl.constexpr,  # bytes a block
    GROUP: tl.constexpr,  # weights a scale group
    K_CHUNK: tl.constexpr,  # inputs an iteration of the main loop (whole groups)
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,  # tl.dot (BLOCK_M >= 16) or broadcast-multiply-and-sum
    DOT_DTYPE: tl.constexpr,  # operand dtype of the dot: x's, or float32
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no tf32 rounding)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)  # tail columns re-read row 0, unstored
    row_base = rows * row_bytes
    x_rows = x_ptr + tl.where(m_ok, offs_m, 0).to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_main = K - K % K_CHUNK
    for k0 in range(0, k_main, K_CHUNK):  # K_CHUNK // GROUP groups at once: loads in flight
        for u in tl.static_range(K_CHUNK // GROUP):
            acc = _accumulate_group(acc, x_rows, m_ok, blocks_ptr, halves_ptr, row_base,
                                    k0 + u * GROUP, FMT, QK, BYTES, GROUP, USE_DOT, DOT_DTYPE,
                                    DOT_PRECISION)  # fmt: skip
    for k0 in range(k_main, K, GROUP):  # the last K % K_CHUNK inputs
        acc = _accumulate_group(acc, x_rows, m_ok, blocks_ptr, halves_ptr, row_base, k0, FMT,
                                QK, BYTES, GROUP, USE_DOT, DOT_DTYPE, DOT_PRECISION)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def interpreted() -> bool:
    """Whether the kernel was built for the CPU interpreter (TRITON_INTERPRET=1)."""
    return not isinstance(_dequant_gemm_kernel, triton.runtime.JITFunction)


def tile_sizes(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for m activation rows: small tiles (more programs) for decode."""
    if m < DOT_MIN_ROWS:
        return triton.next_power_of_2(m), 32
    return (16 if m <= 16 else 32 if m <= 32 else 64), 64


def kernel_constants(dtype: torch.dtype, ggml_type: int, m: int) -> dict[str, object]:
    """The constexpr arguments of the kernel for m rows of `dtype` activations."""
    qk, nbytes, group = LAYOUT[ggml_type]
    block_m, block_n = tile_sizes(m)
    # The interpreter's bf16 dot is wrong (numpy has no bf16): upcast there; exact anyway.
    upcast = dtype == torch.float32 or (interpreted() and dtype == torch.bfloat16)
    dot_dtype = tl.float32 if upcast else _TL[dtype]
    return {
        "FMT": ggml_type, "QK": qk, "BYTES": nbytes, "GROUP": group, "K_CHUNK": K_CHUNK,
        "USE_DOT": block_m >= DOT_MIN_ROWS, "DOT_DTYPE": dot_dtype,
        "DOT_PRECISION": "ieee" if upcast else "tf32",
        "BLOCK_M": block_m, "BLOCK_N": block_n,
    }  # fmt: skip


def dequant_gemm(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32), blocks [N, K / QK * BYTES] uint8 -> [M, N] in x's dtype:
    x @ dequantize(blocks).T (+ bias), summed in float32."""
    if ggml_type not in LAYOUT:
        raise ValueError(f"ggml type {ggml_type} has no Triton dequant GEMM")
    qk, nbytes, _ = LAYOUT[ggml_type]
    m, k = x.shape
    n = blocks.shape[0]
    if k % qk or blocks.shape[1] != k // qk * nbytes or blocks.dtype != torch.uint8:
        raise ValueError(f"blocks {tuple(blocks.shape)} do not hold {k} inputs of type {ggml_type}")
    x, blocks = x.contiguous(), blocks.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    consts = kernel_constants(x.dtype, ggml_type, m)
    grid = (triton.cdiv(m, consts["BLOCK_M"]), triton.cdiv(n, consts["BLOCK_N"]))
    _dequant_gemm_kernel[grid](
        x, blocks, blocks.view(torch.float16), bias if bias is not None else out, out,
        m, n, k, blocks.shape[1], x.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        **consts,
    )  # fmt: skip
    return out


def block_linear(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """[..., K] -> [..., N]: dequant_gemm over x's rows (BlockWeight.linear on CUDA)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    out = dequant_gemm(rows, blocks, ggml_type, bias)  # [M, N]
    return out.reshape(*x.shape[:-1], blocks.shape[0])
