"""Triton fused-MoE for GPU: a grouped GEMM over (token, expert) pairs sorted by expert.

The pairs are sorted by expert id and each expert's group is padded to a multiple of
BLOCK_M (`align_by_expert`), so every BLOCK_M-row tile belongs to one expert: the kernel
program for a tile gathers its token rows, multiplies them by that expert's weight and
scatters the rows back to their pair slots (optionally scaled by the routing weight). Two
launches make the expert MLP: x @ w13[e].T -> SiLU(gate) * up -> @ w2[e].T * weight, then
the k slots of each token are summed. The same structure as vLLM's fused_moe; tested on CPU
under TRITON_INTERPRET=1 against the torch path (worker_service.models.moe.fused_moe_torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [n, k] -> (sorted_pairs [P]: flat pair indices grouped by expert, each group
    padded to a multiple of block_m with the sentinel n * k; block_expert [P // block_m]:
    each block's expert, num_experts for the unused blocks at the end). P is the bound
    n * k + E * (block_m - 1), rounded up to block_m, so no step waits on the device."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts  # [E] first sorted index of each expert
    padded_end = torch.cumsum(padded, 0)
    experts = flat.index_select(0, order)  # [n * k] ascending
    rank = torch.arange(flat.numel(), device=ids.device) - start.index_select(0, experts)
    total = -(-(flat.numel() + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((total,), flat.numel(), dtype=torch.int64, device=ids.device)
    sorted_pairs[(padded_end - padded).index_select(0, experts) + rank] = order
    block_starts = torch.arange(0, total, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)  # E: unused
    return sorted_pairs, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: tokens (pair // A_DIV) or pairs (A_DIV == 1)
    w_ptr,  # [E, N, K]
    c_ptr,  # [n * k, N]: one row per (token, slot) pair
    weight_ptr,  # [n * k] routing weights (read when MUL_WEIGHT)
    sorted_ptr,  # [P] pair indices, padded with num_pairs
    block_expert_ptr,  # [P // BLOCK_M], num_experts past the used blocks
    num_experts,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    A_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no tf32 rounding)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands (the interpreter's bf16 dot is wrong)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return  # a padding block past the last expert's pairs
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(valid, pairs // A_DIV, 0)
    a_tile = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_tile = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_tile, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        if DOT_IN_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_tile += BLOCK_K
        w_tile += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    c = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def interpreted() -> bool:
    """Whether the kernel was built for the CPU interpreter (TRITON_INTERPRET=1)."""
    return not isinstance(_grouped_gemm_kernel, triton.runtime.JITFunction)


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    a_div: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """c [num_pairs, N]: row p = a[p // a_div] @ w[expert of p].T (times weights[p])."""
    n_out, k_in = w.shape[1], w.shape[2]
    c = torch.zeros(num_pairs, n_out, dtype=a.dtype, device=a.device)
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    block_k = min(64, max(16, triton.next_power_of_2(k_in)))
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    a, w = a.contiguous(), w.contiguous()
    _grouped_gemm_kernel[grid](
        a, w, c, weights if weights is not None else c, sorted_pairs, block_expert,
        w.shape[0], num_pairs, n_out, k_in, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        A_DIV=a_div, MUL_WEIGHT=weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=interpreted() and a.dtype == torch.bfloat16,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return c


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [n, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [n, k] -> [n, H] in x's dtype."""
    n, k = ids.shape
    if n == 0:
        return torch.zeros_like(x)
    sorted_pairs, block_expert = align_by_expert(ids, w13.shape[0], BLOCK_M)
    h = grouped_gemm(x.to(w13.dtype), w13, sorted_pairs, block_expert, n * k, k)  # [n * k, 2I]
    gate, up = h.split(w2.shape[2], dim=-1)
    act = F.silu(gate) * up  # [n * k, I]
    scale = weights.reshape(-1).float().contiguous()
    out = grouped_gemm(act, w2, sorted_pairs, block_expert, n * k, 1, scale)  # [n * k, H]
    return out.view(n, k, -1).sum(dim=1).to(x.dtype)
