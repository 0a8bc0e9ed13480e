"""Greedy decoding with HF transformers, the reference that Tessera's tokens are compared
with token for token (tests, benchmarks/gpu_check_quant.py)."""

from __future__ import annotations

from typing import Any

import torch


def hf_greedy_with(
    model: Any, prompt_ids_list: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations of `model` (already built: a PEFT `PeftModel`, say) by HF
    `generate`, one prompt at a time (no padding), never stopping at EOS: exactly
    `max_new_tokens` tokens per prompt."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    results = []
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # else generate falls back to it and stops
    try:
        with torch.inference_mode():
            for ids in prompt_ids_list:
                inputs = torch.tensor([ids])
                out = model.generate(
                    inputs, attention_mask=torch.ones_like(inputs), generation_config=config
                )
                results.append(out[0, len(ids) :].tolist())
    finally:
        model.generation_config.eos_token_id = saved_eos
    return results
