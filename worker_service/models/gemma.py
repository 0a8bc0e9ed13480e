"""Gemma 2 / Gemma 3 text decoders: (1 + weight) RMSNorm, embeddings scaled by
sqrt(hidden), sandwich norms (pre/post attention and feed-forward), GeGLU (tanh GELU),
query_pre_attn_scalar, alternating sliding/global layers, final logit soft-capping, and for
Gemma 3 per-head q/k norms and a local rope base for its sliding layers. Gemma 2's attention
logit soft-capping runs in every backend (on CPU through the plain-torch path: SDPA cannot)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelArchConfig, layer_type_rope
from worker_service.models.cpu_ops import CpuOps
from worker_service.models.layers import Embedding, Linear, RMSNorm, RowParallelLinear
from worker_service.models.llama import LlamaForCausalLM, PagedAttention
from worker_service.models.rope import RotaryEmbedding
from worker_service.parallel import TPGroup, layer_shard


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: normalized and scaled by (1 + weight) in float32, then cast."""

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """[..., size] -> [..., size] in x's dtype."""
        normed = F.rms_norm(x.float(), self.size, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return self.norm(x), x


class GeluMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [n, inter] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-normed block: x + post_attn(attn(in(x))), then x + post_ff(mlp(pre_ff(x)))."""

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup, qk_norm: bool
    ) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = PagedAttention(dataclasses.replace(cfg, qk_norm=False), backend, tp)
        if qk_norm:  # Gemma 3
            self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, eps)
            self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, eps)
        self.self_attn.scale = (
            float(cfg.raw_text.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5
        )
        self.self_attn.softcap = float(cfg.raw_text.get("attn_logit_softcapping") or 0.0)
        self.mlp = GeluMLP(size, layer_shard(cfg, tp.rank, tp.size).intermediate, tp)

    def forward(self, x: torch.Tensor, cis: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = self.post_attention_layernorm.norm(self.self_attn(self.input_layernorm.norm(x), cis))
        x = x + h
        h = self.post_feedforward_layernorm.norm(self.mlp(self.pre_feedforward_layernorm.norm(x)))
        return x + h


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: see the module doc."""

    supported_features: tuple[str, ...] = (
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
    )
    qk_norm = False

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        nn.Module.__init__(self)
        self.config, self.tp = cfg, tp or TPGroup()
        self.shard = layer_shard(cfg, self.tp.rank, self.tp.size)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, backend, self.tp, self.qk_norm) for _ in range(cfg.num_layers)
        )
        windows = cfg.sliding_windows or (0,) * cfg.num_layers
        for attn, window in zip(self.attention_layers(), windows, strict=True):
            attn.sliding_window = window
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope)
        local = layer_type_rope(cfg, "sliding_attention")
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_positions, local)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.softcap = cfg.raw_text.get("final_logit_softcapping")

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn for layer in self.layers if isinstance(layer, GemmaDecoderLayer)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final-normed hidden [num_tokens, hidden]."""
        dtype = self.embed_tokens.weight.dtype
        cis = self.rotary.lookup(positions, dtype)
        cis_local = self.rotary_local.lookup(positions, dtype)
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        x = x * torch.tensor(self.config.hidden_size**0.5).to(dtype)  # as HF rounds it
        for attn, layer in zip(self.attention_layers(), self.layers, strict=True):
            x = layer(x, cis_local if attn.sliding_window else cis)
        return self.norm.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 logits, soft-capped (final_logit_softcapping)."""
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def use_cpu_ops(self, ops: CpuOps) -> None:
        """The fused CPU kernels compute Llama's norm and SiLU: Gemma keeps its torch ops."""
        return None


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: Gemma 2 with q/k norms, and its sliding layers' own rope base."""

    qk_norm = True
