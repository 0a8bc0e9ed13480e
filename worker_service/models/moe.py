"""Mixture-of-experts layers: top-k routing and the fused (grouped) expert MLP.

Experts are stacked: `w13` [E, 2 * I, H] holds every expert's gate rows then up rows,
`w2` [E, H, I] its down projection. `fused_moe` sorts the (token, expert) pairs by expert
id and runs one GEMM per expert over its token group, then scatter-adds the routed-weighted
outputs back to their tokens: no per-token Python loop. On CUDA it runs the Triton grouped
GEMM (worker_service.models.moe_triton); on CPU the torch path below.

Tensor parallel: each rank holds a slice of every expert's intermediate columns (its rows
of w1/w3, its columns of w2); the ranks' partial outputs are summed by one all-reduce, as
the dense MLP's down projection does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.models.config import ModelArchConfig
from worker_service.models.layers import GatedMLP, Linear
from worker_service.parallel import TPGroup


@dataclass(frozen=True)
class MoeConfig:
    """The MoE part of an HF config (names differ per family; read by `moe_config`)."""

    num_experts: int
    top_k: int
    intermediate: int  # per expert
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    fp32_weights: bool = False  # Mixtral keeps routing weights in float32; Qwen/OLMoE cast
    shared_intermediate: int = 0  # Qwen2-MoE: an always-on expert with a sigmoid gate
    sparse_step: int = 1  # Qwen: layer i is sparse iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} not in 1..{self.num_experts}")
        if self.intermediate < 1 or self.sparse_step < 1:
            raise ValueError("MoE intermediate size and decoder_sparse_step must be >= 1")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0


def moe_config(cfg: ModelArchConfig, **family: Any) -> MoeConfig:
    """MoeConfig from the raw HF config; `family` gives the per-family defaults/overrides."""
    raw = {**cfg.raw, **cfg.raw.get("text_config", {})}
    experts = raw.get("num_local_experts", raw.get("num_experts"))
    if experts is None:
        raise ValueError(f"{cfg.architecture}: config has no num_experts / num_local_experts")
    return MoeConfig(
        num_experts=int(experts),
        top_k=int(raw.get("num_experts_per_tok", 2)),
        intermediate=int(raw.get("moe_intermediate_size") or cfg.intermediate_size),
        norm_topk_prob=bool(family.pop("norm_topk_prob", raw.get("norm_topk_prob", False))),
        shared_intermediate=int(raw.get("shared_expert_intermediate_size") or 0),
        sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        **family,
    )


def split_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s [start, end) of `total` columns (or experts) split as evenly as possible."""
    if total < size:
        raise ValueError(f"cannot split {total} expert columns / experts over {size} ranks")
    sizes = [total // size + (r < total % size) for r in range(size)]
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def select_experts(
    logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [n, E] -> (weights [n, k], expert ids [n, k] int64), as HF routes:
    softmax in float32, top-k, optional renormalisation, then (unless `fp32_weights`) the
    weights cast to the logits' dtype."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(logits.dtype)), ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [n, k] -> (order [n * k]: flat (token, slot) indices grouped by ascending expert,
    counts [E]: each expert's group size)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts)


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """x [n, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [n, k] -> [n, H] in x's dtype.

    Grouped: one GEMM per expert hit, over the rows routed to it (in the weights' dtype),
    outputs scaled by their routing weight and index-added per token in ascending expert
    order (HF's order of additions). Expert parallel: w13[i] is global expert
    first_expert + i, and pairs routed to experts held elsewhere are skipped."""
    if ids.shape[0] == 1:  # one token (decode at batch 1): no grouping to do
        return _one_token_moe(x, w13, w2, weights, ids, first_expert)
    k, local = ids.shape[1], w13.shape[0]
    order, counts = sort_by_expert(ids, first_expert + local)
    skip = int(counts[:first_expert].sum()) if first_expert else 0
    sizes = counts[first_expert : first_expert + local].tolist()
    order = order[skip : skip + sum(sizes)]  # this rank's pairs, by ascending expert
    tokens = order // k  # [pairs] the token of each sorted (token, slot) pair
    rows = x.index_select(0, tokens).to(w13.dtype)  # [pairs, H]
    scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)  # [pairs, 1]
    inter = w2.shape[2]
    outs = []
    start = 0
    for e, count in enumerate(sizes):
        if count == 0:
            continue
        group = rows[start : start + count]  # [count, H]
        # GEMMs in the weights' dtype, each result rounded to x's dtype (as a native one)
        gate, up = F.linear(group, w13[e]).to(x.dtype).split(inter, dim=-1)  # [count, I]
        outs.append(F.linear((F.silu(gate) * up).to(w2.dtype), w2[e]).to(x.dtype))
        start += count
    expert_out = torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])  # [pairs, H]
    weighted = (expert_out * scale).to(x.dtype)  # (float32 weights promote, as HF's do)
    return torch.zeros_like(x).index_add_(0, tokens, weighted)


def _one_token_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int,
) -> torch.Tensor:
    """fused_moe_torch for x [1, H]: its k experts in ascending id order, summed from zero."""
    inter = w2.shape[2]
    row = x.to(w13.dtype)
    out = torch.zeros_like(x)
    chosen = sorted((int(e), slot) for slot, e in enumerate(ids[0].tolist()))
    for expert, slot in chosen:
        e = expert - first_expert
        if not 0 <= e < w13.shape[0]:
            continue  # held by another rank (expert parallel)
        gate, up = F.linear(row, w13[e]).to(x.dtype).split(inter, dim=-1)  # [1, I] each
        y = F.linear((F.silu(gate) * up).to(w2.dtype), w2[e]).to(x.dtype)  # [1, H]
        out = out + (y * weights[0, slot]).to(x.dtype)
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
    num_experts: int = 0,
) -> torch.Tensor:
    """The grouped expert MLP on x's device: Triton on CUDA, torch elsewhere. Expert
    parallel: w13/w2 hold experts first_expert.. of `num_experts` (0: all of them)."""
    if not x.is_cuda:
        return fused_moe_torch(x, w13, w2, weights, ids, first_expert)
    from worker_service.models.moe_triton import fused_moe_triton

    if num_experts and w13.shape[0] < num_experts:  # expert parallel: others' pairs -> 0
        local = (ids >= first_expert) & (ids < first_expert + w13.shape[0])
        weights = torch.where(local, weights, torch.zeros_like(weights))
        ids = torch.where(local, ids - first_expert, torch.zeros_like(ids))
    return fused_moe_triton(x, w13, w2, weights, ids)


class FusedMoE(nn.Module):
    """Router + stacked experts; no all-reduce. Tensor parallel: this rank's intermediate
    slice of every expert; expert parallel (`tp.expert_parallel`): whole experts, this
    rank's share of the expert ids."""

    def __init__(self, hidden: int, moe: MoeConfig, tp: TPGroup) -> None:
        super().__init__()
        self.moe = moe
        self.expert_parallel = getattr(tp, "expert_parallel", False) and tp.size > 1
        split = (0, 1) if self.expert_parallel else (tp.rank, tp.size)
        self.inter_start, self.inter_end = split_range(moe.intermediate, *split)
        split = (tp.rank, tp.size) if self.expert_parallel else (0, 1)
        self.expert_start, self.expert_end = split_range(moe.num_experts, *split)
        inter, experts = self.inter_end - self.inter_start, self.expert_end - self.expert_start
        self.gate = Linear(hidden, moe.num_experts, bias=False)  # router (replicated)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden), False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter), False)
        self.compute: tuple[torch.Tensor, torch.Tensor] | None = None  # set by pack()

    def pack(self, dtype: torch.dtype) -> None:
        """Run the expert GEMMs over copies in `dtype` (float32 where bf16 is emulated)."""
        if dtype != self.w13.dtype:
            self.compute = (self.w13.data.to(dtype), self.w2.data.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] -> this rank's partial expert output [n, H]."""
        weights, ids = select_experts(
            self.gate(x), self.moe.top_k, self.moe.norm_topk_prob, self.moe.fp32_weights
        )
        w13, w2 = self.compute or (self.w13, self.w2)
        return fused_moe(x, w13, w2, weights, ids, self.expert_start, self.moe.num_experts)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: routed experts, plus Qwen2-MoE's gated shared expert."""

    def __init__(self, hidden: int, moe: MoeConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.experts = FusedMoE(hidden, moe, tp)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_intermediate:
            start, end = split_range(moe.shared_intermediate, tp.rank, tp.size)
            self.shared_range = (start, end)
            self.shared_expert = GatedMLP(hidden, end - start, tp)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.experts(x))  # [n, H]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # [n, 1]
            out = out + gate * self.shared_expert(x)
        return out
