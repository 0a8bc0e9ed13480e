"""`--quantization int8`: every linear layer of the default model becomes Q8_0 blocks at
load, and Tessera's greedy (float32 activations) equals HF generate over the same weights
(each linear weight replaced by its Q8_0 dequantization), 8 prompts x 32 tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.hf_greedy import hf_greedy_with
from benchmarks.quality import PROMPTS
from services.types import SamplingParams
from tessera import LLM
from worker_service.models.layers import Linear
from worker_service.models.quant import Q8_0, BlockWeight

NEW_TOKENS = 32


def q8_0(weight: torch.Tensor) -> BlockWeight:
    return BlockWeight.quantize_q8_0(weight, None)


def hf_with_quantized_linears(
    model_dir: Path,
    quantize: Callable[[torch.Tensor], BlockWeight] = q8_0,
    head: Callable[[torch.Tensor], BlockWeight] | None = None,
) -> nn.Module:
    """HF's model with each linear weight (the tied LM head too, untied) as the values of
    its `quantize` blocks (Q8_0 by default; the LM head's `head` blocks where given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lm_head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            blocks = (head if head and module is lm_head else quantize)(module.weight.data)
            module.weight = nn.Parameter(blocks.dequantize(torch.float32), requires_grad=False)
    return model


def test_int8_greedy_equals_hf_over_the_same_q8_0_weights(default_model_dir: Path) -> None:
    llm = LLM(quantization="int8", dtype="float32", kv_cache_memory="256MiB", max_num_seqs=8)
    try:
        linears = [m for m in llm.worker.runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.quant is not None and m.quant.ggml_type == Q8_0 for m in linears)
        prompts = [llm.tokenizer.encode(p, False) for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    theirs = hf_greedy_with(hf_with_quantized_linears(default_model_dir), prompts, NEW_TOKENS)
    assert sum(a == b for a, b in zip(ours, theirs, strict=True)) == len(PROMPTS)
