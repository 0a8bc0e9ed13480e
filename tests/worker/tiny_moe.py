"""Tiny random-weight MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) saved the HF way,
with the default model's tokenizer so `LLM` and `tessera serve` can load them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

VOCAB = 49152  # the default model's tokenizer (SmolLM2)
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# eight prompts of 1..61 tokens over the whole vocabulary
PROMPTS = [[(37 * i + 11 * k + 5) % VOCAB for i in range(n)] for k, n in
           enumerate((3, 17, 40, 9, 61, 25, 1, 33))]  # fmt: skip


def _config(kind: str, **overrides: Any) -> Any:
    import transformers as tf

    if kind == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=8, **overrides)
    if kind == "qwen2_moe":  # a shared expert; layer 0 dense (mlp_only_layers); no renorm
        extra: dict[str, Any] = dict(
            num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=40
        )
        extra.update(mlp_only_layers=[0], norm_topk_prob=False)
        return tf.Qwen2MoeConfig(**COMMON, **{**extra, **overrides})
    if kind == "qwen3_moe":  # head_dim != hidden / heads; renormalised top-k
        extra = dict(num_experts=8, moe_intermediate_size=32, head_dim=32)
        extra.update(norm_topk_prob=True)
        return tf.Qwen3MoeConfig(**COMMON, **{**extra, **overrides})
    if kind == "olmoe":
        return tf.OlmoeConfig(**COMMON, num_experts=8, norm_topk_prob=False, **overrides)
    raise ValueError(kind)


def save_tiny_moe(kind: str, path: Path, default_model_dir: Path, **overrides: Any) -> Path:
    """A random tiny `kind` MoE in `path` (norms and biases perturbed so they matter)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
            elif "gate" in name and p.shape[0] <= 8:  # routers: spread the choices
                p.mul_(20.0)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    return path
