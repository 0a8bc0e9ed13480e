"""GGUF's 5-bit (Q5_0, Q5_1) and K-quant (Q4_K, Q5_K, Q6_K) blocks dequantized as ggml (and
the gguf package) does, the same float32 operations in the same order: the values the C++
GEMM (gguf_formats.h spells out the layouts) multiplies by. quant.dequantize_blocks calls
these with the blocks as [rows, blocks, bytes] uint8; each returns [rows, blocks * size]."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _half(raw: torch.Tensor, at: int) -> torch.Tensor:
    """[rows, blocks, bytes] -> the half at byte `at` of each block, [rows, blocks, 1] float32."""
    return raw[..., at : at + 2].contiguous().view(torch.float16).float()


def _shifts(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 16] -> [rows, blocks, 32]: low nibbles, then high nibbles."""
    return torch.cat([qs & 15, qs >> 4], dim=2)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 4] (a little-endian uint32) -> [rows, blocks, 32]: bit j at j."""
    bits = (qh.unsqueeze(-1) >> _shifts(*range(8))) & 1  # [rows, blocks, 4, 8]
    return bits.reshape(*qh.shape[:2], 32)


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    d = _half(raw, 0)
    q = (_nibbles32(raw[..., 6:22]) | (_bits32(raw[..., 2:6]) << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    d, m = _half(raw, 0), _half(raw, 2)
    q = _nibbles32(raw[..., 8:24]) | (_bits32(raw[..., 4:8]) << 4)
    return d * q.float() + m


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, blocks, 12] packed 6-bit scales and mins -> two [rows, blocks, 8] uint8."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=2)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=2)
    return sc, mn


def _k_groups(raw: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: d sc[j] q - dmin mn[j] over the 8 groups of 32 values q [rows, blocks, 8, 32]."""
    sc, mn = scale_min_k4(raw[..., 4:16])
    d = (_half(raw, 0) * sc.float()).unsqueeze(-1)  # [rows, blocks, 8, 1]
    dm = (_half(raw, 2) * mn.float()).unsqueeze(-1)
    return (d * q.float() - dm).flatten(2)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 128] -> [rows, blocks, 8, 32]: group j = qs[32 (j / 2) + i] >> 4 (j % 2)."""
    rows, blocks = qs.shape[:2]
    shifted = qs.reshape(rows, blocks, 4, 1, 32) >> _shifts(0, 4).reshape(2, 1)
    return (shifted & 15).reshape(rows, blocks, 8, 32)


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    return _k_groups(raw, _k_nibbles(raw[..., 16:144]))


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    qh = raw[..., 16:48].unsqueeze(2) >> _shifts(*range(8)).reshape(8, 1)  # [rows, blocks, 8, 32]
    return _k_groups(raw, _k_nibbles(raw[..., 48:176]) | ((qh & 1) << 4))


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    rows, blocks = raw.shape[:2]
    scales = raw[..., 192:208].contiguous().view(torch.int8).float()
    d = (_half(raw, 208) * scales).unsqueeze(-1)  # [rows, blocks, 16, 1]
    ql = raw[..., 0:128].reshape(rows, blocks, 2, 1, 64) >> _shifts(0, 4).reshape(2, 1)
    qh = raw[..., 128:192].reshape(rows, blocks, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(4, 1)
    low = (ql & 15).reshape(rows, blocks, 8, 32)
    high = (qh & 3).reshape(rows, blocks, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (d * q.reshape(rows, blocks, 16, 16).float()).flatten(2)


# ggml type id -> dequantizer of [rows, blocks, bytes] uint8
DEQUANTIZE: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    6: _q5_0, 7: _q5_1, 12: _q4_k, 13: _q5_k, 14: _q6_k,
}  # fmt: skip
