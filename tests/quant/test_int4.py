"""`--quantization int4`: every linear layer but the output head becomes Q4_1 blocks at load,
one scale and offset per group of 32, 64 or 128 weights of a row (a shorter last group where a
row is not whole groups: the default model's 576 inputs in groups of 128), the output head
Q8_0, and Tessera's greedy (float32) equals HF generate over the same weights (each linear
weight its dequantization), 8 prompts x 32 tokens, on the default model and on a tiny random
Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.hf_greedy import hf_greedy_with
from benchmarks.quality import PROMPTS
from gateway.tokenizer import Tokenizer
from services.types import SamplingParams
from tessera import LLM
from tests.quant.prequant_files import save_tiny_llama
from tests.quant.test_int8 import hf_with_quantized_linears, q8_0
from tests.worker.tiny_dense import eight_prompts
from worker_service.models.layers import Linear
from worker_service.models.quant import Q4_1, Q8_0, dequantize_blocks
from worker_service.models.quant_int4 import quantize_q4_1

NEW_TOKENS = 32


def int4_greedy(model: str, group: int, prompts: list[list[int]] | list[str]) -> list[list[int]]:
    """Tessera's float32 greedy tokens under --quantization int4; every linear is Q4_1, the
    output head Q8_0."""
    llm = LLM(model=model, quantization="int4", quantization_group_size=group, dtype="float32",
              kv_cache_memory="256MiB", max_num_seqs=8)  # fmt: skip
    try:
        net = llm.worker.runner.model
        linears = [m for m in net.modules() if isinstance(m, Linear) and m is not net.lm_head]
        assert linears and all(m.quant is not None and m.quant.ggml_type == Q4_1 for m in linears)
        assert net.lm_head.quant is not None and net.lm_head.quant.ggml_type == Q8_0
        ids = [p if isinstance(p, list) else llm.tokenizer.encode(p, False) for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(ids, params)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_greedy_equals_hf_on_the_default_model(group: int, default_model_dir: Path) -> None:
    ours = int4_greedy("default", group, PROMPTS)
    hf = hf_with_quantized_linears(
        default_model_dir, lambda w: quantize_q4_1(w, group, None), head=q8_0
    )
    tokenizer = Tokenizer.load(default_model_dir)
    prompts = [tokenizer.encode(p, False) for p in PROMPTS]
    assert ours == hf_greedy_with(hf, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_greedy_equals_hf_on_a_tiny_llama(group: int, tiny_llama: Path) -> None:
    path = tiny_llama
    ours = int4_greedy(str(path), group, eight_prompts())
    hf = hf_with_quantized_linears(path, lambda w: quantize_q4_1(w, group, None), head=q8_0)
    assert ours == hf_greedy_with(hf, eight_prompts(), NEW_TOKENS)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_group_shares_one_scale_and_offset_and_stays_within_half_a_step(group: int) -> None:
    w = torch.randn(
        8, 576, generator=torch.Generator().manual_seed(group)
    )  # 576 = 4.5 groups of 128: the last group is 64 wide
    blocks = quantize_q4_1(w, group, None)
    raw = blocks.blocks.reshape(8, -1, 20)  # [rows, blocks, {d, m, qs}]
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [rows, blocks]
    m = raw[..., 2:4].contiguous().view(torch.float16)[..., 0]
    groups = torch.arange(0, 576, 32) // group  # [blocks]
    for g in groups.unique():
        same = groups == g
        assert (d[:, same] == d[:, same][:, :1]).all() and (m[:, same] == m[:, same][:, :1]).all()
    error = (dequantize_blocks(blocks.blocks, Q4_1) - w).abs().reshape(8, -1, 32)
    step = d.float()[..., None]
    assert (error <= step * 0.5 + m.float().abs()[..., None] * 2**-11 + 1e-6).all()
