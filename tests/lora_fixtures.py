"""A tiny random Llama with the default model's tokenizer, random PEFT LoRA adapters made
with `peft` itself, and HF PeftModel greedy references (float32): shared by the worker,
offline and serving LoRA tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.hf_greedy import hf_greedy_with

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def build_tiny_llama(out_dir: Path, default_model_dir: Path, seed: int = 0) -> Path:
    """A random-weight Llama (GQA) over the default model's tokenizer, saved the HF way."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(
        **TINY_LLAMA,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # HF sets norms to 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    targets: list[str] | None = None,
    use_rslora: bool = False,
    scale: float = 0.2,
    **extra: Any,
) -> Path:
    """A PEFT LoRA adapter over `base_dir` with random, non-zero A and B, saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        **extra,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: the adapter must change outputs
                p.copy_(torch.randn(p.shape, generator=generator) * scale)
    model.save_pretrained(str(out_dir))
    return out_dir


def peft_greedy(
    base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """HF greedy (float32) of the base model with the adapter (None: the base model alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return hf_greedy_with(model, prompts, max_new_tokens)
