"""The quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3): its slot layout, writes, reads.

A quantized pool is one tensor per layer for K and one for V, as the model-dtype pools are,
with two more elements in each slot's head row:
`[num_blocks, block_size, num_kv_heads, head_dim + 2]` of int8 (or float8_e4m3fn); elements
0..head_dim-1 are the values, the last two hold that token's and head's float16 scale
(amax / 127, or amax / 448 for fp8). So x ~= value * scale, and one head-token takes
head_dim + 2 bytes against 2 * head_dim in bf16 (66 vs 128 at head_dim 64: 1.94x blocks).
The pool's dtype tells the backends which layout they read; nothing else changes hands, and
the block manager sees blocks as it always did (only fewer bytes each).
"""

from __future__ import annotations

import torch

# --kv-cache-dtype -> the pool's element type (auto: the model dtype).
POOL_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QUANTIZED = frozenset(POOL_DTYPES.values())
SCALE_ELEMS = 2  # one float16 scale per slot and head, as two 1-byte elements
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_MIN_SCALE = 2.0**-14  # smallest normal float16: an all-zero row still divides by it


def pool_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool element type for --kv-cache-dtype `cache_dtype` ("auto": the model dtype)."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in POOL_DTYPES:
        raise ValueError(f"unknown kv cache dtype {cache_dtype!r}")
    return POOL_DTYPES[cache_dtype]


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether `cache` is a quantized pool (values + scales in each slot's head row)."""
    return cache.dtype in QUANTIZED


def slot_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one slot's head row in a pool of `dtype`."""
    if dtype not in QUANTIZED:
        return head_dim
    if head_dim % 2:
        raise ValueError(f"a quantized KV cache needs an even head size, not {head_dim}")
    return head_dim + SCALE_ELEMS


def quantize(
    x: torch.Tensor,  # [..., head_dim]
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., head_dim + 2] of dtype: values, then the float16 scale's bytes
    """Each row of `x` as 8-bit values with one float16 scale (amax / qmax) of its own."""
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / qmax).clamp_(min=_MIN_SCALE).half()  # [..., 1]
    q = (xf / scale.float()).clamp_(-qmax, qmax)
    values = q.round_().to(dtype) if dtype == torch.int8 else q.to(dtype)
    return torch.cat([values, scale.view(dtype)], dim=-1)


def scales(packed: torch.Tensor) -> torch.Tensor:  # [...] float32
    """The float16 scale of each row of a quantized `[..., head_dim + 2]` tensor."""
    raw = packed[..., -SCALE_ELEMS:].contiguous().view(torch.float16)  # [..., 1]
    return raw.squeeze(-1).float()


def dequantize(
    packed: torch.Tensor,  # [..., head_dim + 2] quantized
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., head_dim] of dtype
    """Values times their row's scale (float32 math), as `dtype`."""
    values = packed[..., :-SCALE_ELEMS].float()
    return (values * scales(packed).unsqueeze(-1)).to(dtype)


def gather(
    cache: torch.Tensor,  # [n_rows, ..., slot width] (a pool, or a flat view of one)
    index: torch.Tensor,  # [n] row ids
    dtype: torch.dtype,
) -> torch.Tensor:  # [n, ..., head_dim]
    """Rows `index` of a pool, dequantized to `dtype` from a quantized pool, else as they are."""
    rows = index_select(cache, index)
    return dequantize(rows, dtype) if is_quantized(rows) else rows


def flat_pool(cache: torch.Tensor) -> torch.Tensor:
    """View a `[num_blocks, block_size, kv_heads, width]` pool as `[num_slots, kv_heads,
    width]` without copying (writes through the view land in the pool)."""
    if not cache.is_contiguous():
        raise ValueError("the KV pool must be contiguous")
    num_blocks, block_size, kv_heads, width = cache.shape
    return cache.view(num_blocks * block_size, kv_heads, width)


def write(
    x: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, slot width]
    slots: torch.Tensor,  # [num_tokens] int64, all >= 0
) -> None:
    """Store each token's rows at its slot, quantized first when the pool is."""
    flat = flat_pool(cache)  # [num_slots, kv_heads, width]
    if not is_quantized(cache):
        flat.index_copy_(0, slots, x.to(cache.dtype))
        return
    rows = quantize(x, cache.dtype)
    flat.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))  # (no fp8 kernels)


def index_select(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, index), also for float8 pools (copied as bytes)."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache.index_select(0, index)
    return cache.view(torch.uint8).index_select(0, index).view(cache.dtype)
