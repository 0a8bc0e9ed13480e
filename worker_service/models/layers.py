"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding, fused MLP.

Precision rule (HF's): weights, matmuls and the residual stream are in the model
dtype (bf16 by default); RMSNorm statistics, RoPE angles, attention softmax and
matmul accumulation are float32, and the logits are returned as float32.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from worker_service import native
from worker_service.models import cpu_ops
from worker_service.models.cpu_ops import AMX_ONEDNN_ROWS, SMALL_GEMM_ROWS, CpuOps, pack_amx
from worker_service.models.quant import BlockWeight, for_bf16
from worker_service.models.rope import RotaryEmbedding  # noqa: F401 (re-exported)
from worker_service.parallel import TPGroup

# oneDNN builds one GEMM primitive per (rows, weight) shape and keeps it twice, in its own
# cache and in ideep's, 1,024 of each by default. At a few hundred KB apiece (AMX kernels),
# a server that keeps meeting new batch sizes grew by ~40 MB per 64 requests and had not
# levelled off after 2,000 (`make soak`). 256 bounds that and keeps the hot shapes: a miss
# costs ~1.3 ms to rebuild one primitive, against ~0.14 ms for a cached GEMM.
ONEDNN_CACHE_CAPACITY = "256"
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def pack_onednn(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] -> a copy in `dtype`, pre-packed for oneDNN when torch has it (CPU).

    oneDNN's packed GEMMs skip the per-call weight repacking of the default path:
    float32 packed runs 1.5-3x faster than BLAS at serving batch sizes on AVX2, and bf16
    packed (AMX / AVX512-BF16) 1.2-2x faster than F.linear's bf16 at 1..512 rows and
    ~6x at one row for the LM head (measured on Sapphire Rapids, one thread).
    """
    weight = weight.to(dtype)
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return weight
    for name in ONEDNN_CACHE_VARIABLES:  # read once, at the first primitive; a user's value wins
        os.environ.setdefault(name, ONEDNN_CACHE_CAPACITY)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear_onednn(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """[n, in] -> [n, out] GEMM over a `pack_onednn` weight, in the weight's dtype."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class HoldsBlocks(nn.Module):
    """A module whose float `weight` GGUF blocks may replace (`set_blocks`): a Linear's
    GEMMs, an Embedding's lookups."""

    weight: torch.Tensor
    quant: BlockWeight | None = None  # the blocks, once set_blocks() replaced the weight

    def set_blocks(self, weight: BlockWeight) -> None:
        """Use `weight` from now on and drop the float weight."""
        self.quant = weight
        # Rebound, not emptied in place: a tied LM head shares its Parameter with the embedding.
        empty = torch.empty(0, dtype=self.weight.dtype, device=weight.blocks.device)
        self.weight = nn.Parameter(empty, requires_grad=False)


class Linear(HoldsBlocks, nn.Linear):
    """nn.Linear that can run its GEMMs through oneDNN over a pre-packed weight.

    `pack(dtype)` keeps a packed copy of the weight in `dtype`: the model dtype where the
    CPU computes it natively (bf16 on AMX / AVX512-BF16), or float32 where bf16 GEMMs
    would be emulated (AVX2): bf16 x bf16 products are exact in float32, so a float32
    GEMM over upcast weights, rounded back to bf16, computes what a native bf16 GEMM
    with float32 accumulation does (up to summation order), at float32 speed. There, up
    to SMALL_GEMM_ROWS rows (decode, speculative verify) run the fused CPU ops' GEMM over
    the bf16 weight instead: it reads half the bytes of the float32 copy. So do they where
    the CPU has bf16 pair dot products (AVX512-BF16): there that GEMM beats oneDNN's packed
    bf16 one up to 8 rows (5.4 vs 6.8 ms a step of the default model's layers at one row,
    7.5 vs 8.5 at eight; Zen 4, 2 threads). Where the CPU has AMX tiles, every row count runs
    the AMX GEMM over a copy of the weight in its tile layout (`amx`) instead of oneDNN's
    packed one, which it beats at every size (default model's layers, 2 threads: 32 rows
    12.8 vs 24.8 ms, 128 rows 36.8 vs 51.1, 2048 rows 324 vs 436).

    Batch-invariant mode (`tile_rows` > 0, --deterministic): the rows run as GEMMs of exactly
    `tile_rows` rows each (the last tile zero-padded), so every call has one shape, one kernel
    and one blocking, and a row's bits do not depend on how many rows came with it (oneDNN's
    float32 and MKL's GEMMs otherwise change their reduction with the row count).
    """

    packed: torch.Tensor | None = None  # set by pack()
    compute_dtype: torch.dtype | None = None
    # Below this many rows the plain GEMV beats a float32 one over upcast weights (AVX2).
    min_rows = 0
    small_gemm: CpuOps | None = None  # few-row bf16 GEMM (pack(): upcast bf16, or AVX512-BF16)
    amx: torch.Tensor | None = None  # the bf16 weight in AMX tile layout (pack(), AMX CPUs)
    defer_weights = False  # set by deferred_weights(): new weights start on the meta device
    tile_rows = 0  # > 0: batch-invariant GEMMs in tiles of this many rows (class doc)

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        meta = torch.device("meta") if Linear.defer_weights else None
        super().__init__(in_features, out_features, bias, device=meta)

    def quantize(self) -> None:
        """Weight-only int8: keep the weight as Q8_0 blocks (quant.BlockWeight)."""
        self.set_blocks(BlockWeight.quantize_q8_0(self.weight.data, cpu_ops.load()))

    def pack(self, dtype: torch.dtype) -> None:
        """Run GEMMs over a oneDNN-packed copy of the weight in `dtype` (blocks: in their
        layout for `dtype`'s GEMM)."""
        if self.quant is not None:  # bf16 activations whatever the dense GEMMs' dtype
            if torch.bfloat16 in (dtype, self.weight.dtype):
                self.quant = for_bf16(self.quant)
            return
        self.compute_dtype = dtype
        upcast = dtype != self.weight.dtype
        bf16 = self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu"
        if bf16 and (upcast or native.cpu_level() == "AVX512_BF16"):
            self.weight.data = self.weight.data.contiguous()
            self.small_gemm = cpu_ops.load()
        amx = bf16 and self.small_gemm is not None and self.small_gemm.amx
        if amx and self.in_features % 32 == 0:
            self.amx = pack_amx(self.weight.data)  # every row count: no oneDNN copy
            return
        self.packed = pack_onednn(self.weight.data, dtype)
        self.packed_bias = None if self.bias is None else self.bias.data.to(dtype)
        self.min_rows = 3 if upcast else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows:
            return in_row_tiles(self._gemm, x, self.tile_rows)
        return self._gemm(x)

    def gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gated MLP's gate_up: silu(gate) * up, [n, out / 2], in one AMX GEMM that
        never writes [n, out] (cpu_ops.gemm_amx_gated: the same bits as forward then
        silu_mul); None where that GEMM does not run (then forward and silu_mul)."""
        inter = self.out_features // 2
        if self.quant is not None or self.amx is None or self.tile_rows or inter % 16:
            return None
        if not x.numel() or self._onednn_rows(x):
            return None
        assert self.small_gemm is not None
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [n, in]
        out = self.small_gemm.gemm_amx_gated(flat, self.amx, self.bias, inter)
        return out.reshape(*x.shape[:-1], inter).to(x.dtype)

    def _onednn_rows(self, x: torch.Tensor) -> bool:
        """Whether x has AMX_ONEDNN_ROWS rows or more: oneDNN's GEMM beats the tiles there."""
        return x.numel() >= AMX_ONEDNN_ROWS * self.in_features

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """[n, in] -> [n, out] by the fastest kernel for n rows."""
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        if self.amx is not None and x.numel() > 0:  # (x in bf16, as oneDNN's packed path)
            assert self.small_gemm is not None
            flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [n, in]
            if self._onednn_rows(x):  # prefill: oneDNN's brgemm over the plain weight
                out = F.linear(flat, self.weight, self.bias)
            else:
                out = self.small_gemm.gemm_amx(flat, self.amx, self.bias, self.out_features)
            return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.small_gemm is not None and _few_bf16_rows(x, SMALL_GEMM_ROWS):
            return self.small_gemm.gemm_bf16(x, self.weight, self.bias)
        if x.shape[0] < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        out = linear_onednn(x.to(self.compute_dtype), self.packed, self.packed_bias)
        return out.to(x.dtype)


def in_row_tiles(
    gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int
) -> torch.Tensor:
    """gemm over [..., in] x as calls of exactly `rows` rows ([rows, in], contiguous, the
    allocator's alignment; the last tile zero-padded), concatenated: [..., out]."""
    flat = x.reshape(-1, x.shape[-1])  # [n, in]
    n = flat.shape[0]
    if n == 0:
        return gemm(x)
    padded = flat.new_zeros(-(-n // rows) * rows, flat.shape[1])  # [tiles * rows, in]
    padded[:n] = flat
    outs = [gemm(padded[i : i + rows].clone()) for i in range(0, n, rows)]
    out = torch.cat(outs)[:n] if len(outs) != 1 else outs[0][:n]  # [n, out]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Embedding(HoldsBlocks, nn.Embedding):
    """nn.Embedding whose table may stay in GGUF blocks (`set_blocks`): a lookup dequantizes
    the rows it reads, as the whole table would be, so a GGUF model keeps no float copy."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> [..., embedding_dim] in the weight's dtype."""
        if self.quant is None:
            return super().forward(input_ids)
        rows = self.quant.rows(input_ids.reshape(-1), self.weight.dtype)  # [n, dim]
        return rows if input_ids.dim() == 1 else rows.reshape(*input_ids.shape, rows.shape[-1])


@contextmanager
def deferred_weights(defer: bool = True) -> Iterator[None]:
    """Linears built inside start with meta (unallocated) weights, for a loader that gives
    them blocks (set_blocks) or real tensors before use: a GGUF model is never dense."""
    before, Linear.defer_weights = Linear.defer_weights, defer
    try:
        yield
    finally:
        Linear.defer_weights = before


def _few_bf16_rows(x: torch.Tensor, rows: int) -> bool:
    """Whether x is [1..rows, in] bf16 (the few-row GEMMs' input)."""
    return x.dim() == 2 and 0 < x.shape[0] <= rows and x.dtype == torch.bfloat16


class RowParallelLinear(Linear):
    """Tensor parallel: a Linear over this rank's slice of the input features (the output
    of a column-parallel layer); the ranks' partial outputs are summed by an all-reduce.
    Column-parallel layers need no class of their own: a Linear with this rank's share of
    the output rows (the loader slices the checkpoint). No bias (o_proj and down_proj)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class RMSNorm(nn.Module):
    """RMSNorm as HF computes it: normalized in float32, cast back, scaled by the weight.

    `forward(x, residual)` fuses the residual add: it returns
    `(norm(x + residual), x + residual)`, as vLLM does. The residual stream stays in
    the model dtype like HF's, so bf16 results track HF bf16 (acceptance 4).
    """

    ops: CpuOps | None = None  # fused CPU kernel (LlamaForCausalLM.use_cpu_ops)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.size = (size,)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """[..., size] -> [..., size] in x's dtype."""
        return F.rms_norm(x.float(), self.size, None, self.eps).to(x.dtype) * self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops is not None:  # one call; updates `residual` in place
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self.norm(x), x


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one matmul."""

    ops: CpuOps | None = None  # fused CPU kernel (LlamaForCausalLM.use_cpu_ops)

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()  # tensor parallel: `intermediate` is this rank's columns
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            gate_up = self.gate_up_proj  # a LoRA wrapper (lora.manager) keeps the two steps
            gated = gate_up.gated(x) if isinstance(gate_up, Linear) else None
            return self.down_proj(gated if gated is not None else self.ops.silu_mul(gate_up(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [n, inter] each
        return self.down_proj(F.silu(gate) * up)
