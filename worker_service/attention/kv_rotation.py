"""The Hadamard rotation of an int8 KV cache (--kv-cache-dtype int8).

A few K channels carry outliers far larger than the rest, so one amax scale per token and head
spends most of the 8-bit range on them. Rotating each K row by a fixed orthogonal matrix H
(the normalized Sylvester Hadamard matrix, head_dim x head_dim) spreads every channel over all
of them before quantizing; rotating every query by the same H leaves the scores unchanged,
(q H)(k H)^T = q H H^T k^T = q k^T. Perplexity of the default model over an int8 cache
against the model-dtype cache, before -> K rotated -> K and V rotated (ROTATE_V, the output
rotated back, P (v H) H^T = P v): benchmarks.quality (whole text, 512-token windows) bf16
1.0057x -> 1.0045x -> 0.9997x, fp32 1.0020x -> 1.0035x -> 0.9998x; the 600-token sample of
tests/offline/test_kv_cache_dtype (bf16) 1.013x -> 1.0032x -> 1.0114x, greedy agreement with
the auto cache 4/8 -> 4/8 -> 2/8. V stays unrotated: its gain did not hold on both texts.

The backends' shared entry points (AttentionBackend.write_kv / forward) apply it, so every
backend, prefix-cached block, chunked prefill and decode step sees the same rotated K. Only
int8 pools are rotated: a model-dtype pool, an fp8_e4m3 pool (a float format keeps ~1/16 of
each value, outlier or not; spreading the outlier only enlarges every value and its error),
or a head_dim that is not a power of two (no Sylvester matrix) keeps K as it is.
"""

from __future__ import annotations

import functools

import torch

# Rotate V as well (and the attention output back by H^T): off, mixed results (module doc).
ROTATE_V = False


def applies(cache: torch.Tensor, head_dim: int) -> bool:
    """Whether K/V written to (and queries read against) `cache` are rotated: int8 pools of
    a power-of-two head size."""
    return cache.dtype == torch.int8 and head_dim > 1 and head_dim & (head_dim - 1) == 0


@functools.lru_cache(maxsize=16)
def hadamard(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix [head_dim, head_dim]: symmetric, H @ H = I.
    head_dim must be a power of two."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head size, not {head_dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / head_dim**0.5).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:  # [..., head_dim] -> [..., head_dim], x's dtype
    """x @ H in float32 (H is symmetric, so this is also its inverse), as x's dtype."""
    h = hadamard(x.shape[-1], torch.float32, x.device)
    return (x.float() @ h).to(x.dtype)
