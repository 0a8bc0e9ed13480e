"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Each is the Llama-family decoder (worker_service.models.llama: paged attention, RMSNorm,
RoPE) with a SparseMoeBlock as the MLP of its sparse layers. Checkpoints store each expert's
projections separately (`experts.{e}.w1/w3/w2`, or `gate_proj/up_proj/down_proj`) or, as
some exporters do, fused 3D tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]); both are copied into the stacked `w13` / `w2` (see `load_checkpoint_tensor`,
called by worker_service.loader).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelArchConfig
from worker_service.models.context import get_attention_metadata
from worker_service.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from worker_service.models.llama import DecoderLayer, LlamaForCausalLM, PagedAttention
from worker_service.models.moe import FusedMoE, MoeConfig, SparseMoeBlock, moe_config
from worker_service.parallel import TPGroup, layer_shard

# layers.{i}.{block}.experts.{e}.{proj}.weight -> (layer, expert, projection)
_EXPERT = re.compile(
    r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# layers.{i}.{block}.experts.{gate_up_proj|down_proj}: fused 3D expert tensors
_FUSED3D = re.compile(
    r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$"
)
_SHARED = re.compile(r"layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")
_ROUTER = re.compile(
    r"layers\.(\d+)\.block_sparse_moe\.gate\.weight$|layers\.(\d+)\.mlp\.gate\.weight$"
)
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}


class OlmoeAttention(PagedAttention):
    """OLMoE attention: RMSNorm over the whole q and k projections (not per head), and
    q/k/v clamped to +-clip_qkv when the config sets it."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup) -> None:
        super().__init__(dataclasses.replace(cfg, qk_norm=False), backend, tp)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, cfg.rms_norm_eps)
        clip = cfg.raw.get("clip_qkv")
        self.clip = None if clip is None else float(clip)
        # tensor parallel: this rank holds some heads; the norm's mean square is over all
        self.tp = tp
        self.totals = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, q_size], k [n, kv_size] -> RMS-normed over the whole (all ranks') width."""
        assert self.q_norm is not None and self.k_norm is not None
        if self.tp.size == 1:
            return self.q_norm.norm(q), self.k_norm.norm(k)
        qf, kf = q.float(), k.float()
        sums = torch.stack([qf.square().sum(-1), kf.square().sum(-1)], dim=1)  # [n, 2]
        sums = self.tp.all_reduce(sums)
        out = []
        for x, xf, total, s, norm in zip(
            (q, k), (qf, kf), self.totals, sums.unbind(1), (self.q_norm, self.k_norm), strict=True
        ):
            scaled = xf * torch.rsqrt(s / total + norm.eps).unsqueeze(1)
            out.append(scaled.to(x.dtype) * norm.weight)
        return out[0], out[1]

    def forward(self, x: torch.Tensor, cis: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n, q_size = x.shape[0], self.num_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, self.split[1], self.split[1]], dim=-1)
        q, k = self._norm_qk(q, k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        qk = torch.cat([q, k], dim=-1).view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = RotaryEmbedding.rotate(qk, cis)  # [n, heads + kv_heads, head_dim]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        meta = get_attention_metadata()
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, q_size))


class MoeDecoderLayer(DecoderLayer):
    """DecoderLayer (same forward) whose MLP is a SparseMoeBlock on sparse layers."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        backend: AttentionBackend,
        tp: TPGroup,
        moe: MoeConfig,
        layer: int,
        attention: type[PagedAttention],
    ) -> None:
        nn.Module.__init__(self)  # (DecoderLayer.__init__ would build a dense MLP)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if moe.is_sparse(layer):
            self.mlp = SparseMoeBlock(cfg.hidden_size, moe, tp)  # type: ignore[assignment]
        else:
            self.mlp = GatedMLP(
                cfg.hidden_size, layer_shard(cfg, tp.rank, tp.size).intermediate, tp
            )


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Llama attention, every layer sparse, top-k renormalised (float32 weights)."""

    attention: type[PagedAttention] = PagedAttention

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        cfg = self.adapt_config(cfg)
        super().__init__(dataclasses.replace(cfg, num_layers=0), backend, tp)
        self.config = cfg
        self.moe = self.moe_config(cfg)
        self.layers = nn.ModuleList(
            MoeDecoderLayer(cfg, backend, self.tp, self.moe, i, self.attention)
            for i in range(cfg.num_layers)
        )
        experts = [m for m in self.modules() if isinstance(m, FusedMoE)]
        # the global expert ids this rank holds (all but under expert parallelism)
        self.expert_ids = range(
            *((experts[0].expert_start, experts[0].expert_end) if experts else (0, 0))
        )

    @classmethod
    def moe_config(cls, cfg: ModelArchConfig) -> MoeConfig:
        return moe_config(cfg, norm_topk_prob=True, fp32_weights=True)

    def pack_linears(self, dtype: torch.dtype) -> None:
        super().pack_linears(dtype)
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.pack(dtype)

    # ------------------------------------------------------------ checkpoint
    def _block(self, layer: int) -> SparseMoeBlock:
        mlp = self.layers[layer].mlp
        if not isinstance(mlp, SparseMoeBlock):
            raise ValueError(f"layer {layer} is dense but the checkpoint has experts for it")
        return mlp

    def _experts(self, layer: int) -> FusedMoE:
        return self._block(layer).experts

    def _shared(self, layer: int) -> GatedMLP:
        shared = self._block(layer).shared_expert
        if shared is None:
            raise ValueError(f"layer {layer} has no shared expert but the checkpoint has one")
        return shared

    def read_checkpoint_share(self, f: Any, full_name: str) -> torch.Tensor | None:
        """Tensor parallel: this rank's slice of an expert / shared-expert tensor (None: not
        one; the loader's own rule applies)."""
        name = full_name.removeprefix("model.")
        if m := _EXPERT.search(name):
            moe, proj = self._experts(int(m[1])), m[3]
            if int(m[2]) not in self.expert_ids:
                return torch.empty(0)  # another rank's expert (expert parallel): not read
            start, end = moe.inter_start, moe.inter_end
        elif m := _SHARED.search(name):
            proj = m[2]
            start, end = self._block(int(m[1])).shared_range
        else:
            return f.get_tensor(full_name) if _FUSED3D.search(name) else None
        sl = f.get_slice(full_name)  # down projections: input columns; gate/up: output rows
        return sl[:, start:end] if _PART[proj] == 2 else sl[start:end]

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> set[str] | None:
        """Copy an MoE checkpoint tensor into its place; the names it filled (None: not an
        MoE tensor)."""
        if m := _ROUTER.search(name):
            layer = int(m[1] or m[2])
            self._experts(layer).gate.weight.data.copy_(tensor)
            return {f"layers.{layer}.mlp.experts.gate.weight"}
        if m := _EXPERT.search(name):
            layer, expert, part = int(m[1]), int(m[2]), _PART[m[3]]
            moe = self._experts(layer)
            if expert not in self.expert_ids:
                return set()  # another rank's (expert parallel)
            inter, local = moe.inter_end - moe.inter_start, expert - moe.expert_start
            if part == 2:
                moe.w2.data[local].copy_(tensor)
            else:
                moe.w13.data[local, part * inter : (part + 1) * inter].copy_(tensor)
            return {f"layers.{layer}.mlp.experts.{'w2' if part == 2 else 'w13'}#{expert}.{part}"}
        if m := _FUSED3D.search(name):
            return self._load_fused3d(int(m[1]), m[2], tensor)
        if m := _SHARED.search(name):
            part, mlp = _PART[m[2]], self._shared(int(m[1]))
            if part == 2:
                mlp.down_proj.weight.data.copy_(tensor)
            else:
                mlp.gate_up_proj.weight.data[
                    part * mlp.intermediate : (part + 1) * mlp.intermediate
                ].copy_(tensor)
            return {f"layers.{m[1]}.mlp.shared_expert#{part}"}
        return None

    def _load_fused3d(self, layer: int, proj: str, tensor: torch.Tensor) -> set[str]:
        moe = self._experts(layer)
        start, end = moe.inter_start, moe.inter_end
        full, ids = self.moe.intermediate, self.expert_ids
        tensor = tensor[ids.start : ids.stop]  # this rank's experts
        if proj == "down_proj":  # [E, H, I]
            moe.w2.data.copy_(tensor[:, :, start:end])
            parts = [(e, 2) for e in ids]
        else:  # [E, 2I, H]: gate rows then up rows
            moe.w13.data.copy_(
                torch.cat([tensor[:, start:end], tensor[:, full + start : full + end]], 1)
            )
            parts = [(e, p) for e in ids for p in (0, 1)]
        return {f"layers.{layer}.mlp.experts.{'w2' if p == 2 else 'w13'}#{e}.{p}" for e, p in parts}

    def checkpoint_parts(self, param: str) -> list[str] | None:
        """The loaded-names a stacked / fused MoE parameter needs (None: the loader's rule)."""
        prefix, _, leaf = param.rpartition(".")
        if leaf == "w13":
            return [f"{prefix}.w13#{e}.{p}" for e in self.expert_ids for p in (0, 1)]
        if leaf == "w2":
            return [f"{prefix}.w2#{e}.2" for e in self.expert_ids]
        if ".shared_expert." in param:
            block = prefix.split(".shared_expert.")[0]
            return [f"{block}.shared_expert#{p}" for p in ((0, 1) if "gate_up" in param else (2,))]
        return None


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    """Qwen2-MoE: q/k/v biases (`qkv_bias`), optional top-k renormalisation, a shared expert
    with a sigmoid gate, dense layers by `decoder_sparse_step` / `mlp_only_layers`."""

    @classmethod
    def adapt_config(cls, cfg: ModelArchConfig) -> ModelArchConfig:
        return dataclasses.replace(cfg, attention_bias=bool(cfg.raw.get("qkv_bias", True)))

    @classmethod
    def moe_config(cls, cfg: ModelArchConfig) -> MoeConfig:
        return moe_config(cfg)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE: per-head q/k RMSNorm, no shared expert, no biases."""

    @classmethod
    def adapt_config(cls, cfg: ModelArchConfig) -> ModelArchConfig:
        if cfg.attention_bias:
            raise ValueError("Qwen3-MoE with attention_bias is not supported")
        return dataclasses.replace(cfg, qk_norm=True)


class OlmoeForCausalLM(Qwen2MoeForCausalLM):
    """OLMoE: whole-projection q/k norm, clip_qkv, every layer sparse."""

    attention = OlmoeAttention

    def read_checkpoint_share(self, f: Any, full_name: str) -> torch.Tensor | None:
        """Tensor parallel: the q/k norm weights span all heads; this rank reads its heads'."""
        if full_name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            hd, shard = self.config.head_dim, self.shard
            q = (shard.q_start * hd, (shard.q_start + shard.num_heads) * hd)
            start, end = q if "q_norm" in full_name else (shard.kv_start * hd, shard.kv_end * hd)
            return f.get_slice(full_name)[start:end]
        return super().read_checkpoint_share(f, full_name)

    @classmethod
    def adapt_config(cls, cfg: ModelArchConfig) -> ModelArchConfig:
        if cfg.attention_bias:
            raise ValueError("OLMoE with attention_bias is not supported")
        return cfg
