"""Llama-family decoder for paged attention: Llama/Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The model holds only weights and math. The runner binds each attention layer to
its KV pool (`bind_kv_cache`) and sets the step's metadata with
`forward_context`, so `forward(input_ids, positions)` stays clean.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelArchConfig
from worker_service.models.context import get_attention_metadata
from worker_service.models.cpu_ops import CpuOps
from worker_service.models.layers import (
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)
from worker_service.parallel import TPGroup, layer_shard


class PagedAttention(nn.Module):
    """Self-attention over the paged KV pool: fused qkv, RoPE, optional q/k norm, GQA.

    Tensor parallel: this rank's q heads and KV heads (qkv column-parallel, o_proj
    row-parallel), and a KV pool of its KV heads only."""

    ops: CpuOps | None = None  # fused CPU RoPE (LlamaForCausalLM.use_cpu_ops)

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        tp = tp or TPGroup()
        shard = layer_shard(cfg, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shard.num_heads,
            shard.num_kv_heads,
            cfg.head_dim,
        )
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.split = [q_size + kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = 0  # this layer's window (0: full attention), set by the model
        self.softcap = 0.0  # attention score soft-capping (Gemma 2), set by the model
        self.backend = backend
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, cis: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split(self.split, dim=-1)
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                [
                    self.q_norm.norm(qk[:, : self.num_heads]),
                    self.k_norm.norm(qk[:, self.num_heads :]),
                ],
                dim=1,
            )
        if self.ops is not None and 2 * cis[0].shape[-1] == self.head_dim:  # full rotary
            self.ops.rope_(qk, *cis)  # in place, inside the qkv output
        else:
            qk = RotaryEmbedding.rotate(qk, cis)  # [n, heads + kv_heads, head_dim]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        meta = get_attention_metadata()
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.forward(
            q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window, self.softcap
        )
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block with the residual carried separately."""

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = PagedAttention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        tp = tp or TPGroup()
        intermediate = layer_shard(cfg, tp.rank, tp.size).intermediate
        self.mlp = GatedMLP(cfg.hidden_size, intermediate, tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cis: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cis)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / SmolLM2: embeddings, decoder layers, final norm, (tied) LM head.

    Tensor parallel (`tp`): the decoder layers hold this rank's share; the embedding and
    the LM head are replicated (see worker_service.parallel)."""

    splits_for_tp = True  # False: parts no rank splits (a vision tower) refuse tp > 1
    supported_features: tuple[str, ...] = ()  # config features served (config.attention_features)

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        if tp is not None and tp.size > 1 and not self.splits_for_tp:
            raise ValueError("tensor parallelism does not split vision-language models yet")
        super().__init__()
        cfg = self.adapt_config(cfg)
        self.config = cfg
        self.tp = tp or TPGroup()
        self.shard = layer_shard(cfg, self.tp.rank, self.tp.size)  # this rank's heads, columns
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, self.tp) for _ in range(cfg.num_layers)
        )
        for attn, window in zip(self.attention_layers(), cfg.sliding_windows, strict=False):
            attn.sliding_window = window
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one Parameter, as HF ties them

    @classmethod
    def adapt_config(cls, cfg: ModelArchConfig) -> ModelArchConfig:
        """Architecture-specific options (subclasses switch on bias / q-k norm)."""
        return cfg

    def split_checkpoint(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Checkpoint tensor -> the (name, tensor) pieces the loader places (one, here)."""
        return [(name, tensor)]

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn for layer in self.layers if isinstance(layer, DecoderLayer)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final-normed hidden [num_tokens, hidden].
        `input_embeds` [num_tokens, hidden], when given, replaces the token embeddings."""
        cis = self.rotary.lookup(positions, self.embed_tokens.weight.dtype)
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cis)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 logits (accumulated in float32 by the matmul)."""
        return self.lm_head(hidden).float()

    def use_cpu_ops(self, ops: CpuOps) -> None:
        """Run RMSNorm + residual, RoPE and SiLU * up as fused CPU kernels."""
        for module in self.modules():
            if isinstance(module, RMSNorm | PagedAttention | GatedMLP):
                module.ops = ops

    def pack_linears(self, dtype: torch.dtype) -> None:
        """Run every GEMM over a oneDNN-packed weight in `dtype` (see layers.Linear)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(dtype)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q/k/v projections (sliding windows on the layers from
    max_window_layers on, with use_sliding_window)."""

    supported_features: tuple[str, ...] = ("sliding_window",)

    @classmethod
    def adapt_config(cls, cfg: ModelArchConfig) -> ModelArchConfig:
        return dataclasses.replace(cfg, attention_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k before RoPE."""

    @classmethod
    def adapt_config(cls, cfg: ModelArchConfig) -> ModelArchConfig:
        return dataclasses.replace(cfg, qk_norm=True)
