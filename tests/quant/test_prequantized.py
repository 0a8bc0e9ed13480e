"""AWQ and GPTQ checkpoints load as they are: written in-process from a tiny random Llama in
the published layouts (tests/quant/prequant_files.py), served by `LLM(model=DIR)` from Q4
blocks, and Tessera's greedy (float32) equals HF generate over the same weights dequantized
with the published formulas, 8 prompts x 32 tokens; bad configs are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.hf_greedy import hf_greedy_with
from services.types import SamplingParams
from tessera import LLM
from tests.quant.prequant_files import hf_with_weights, save_tiny_llama, write_quantized
from tests.worker.tiny_dense import eight_prompts
from tests.worker.tiny_families import save_family
from worker_service.models.layers import Linear
from worker_service.models.quant import Q4_0, Q4_1
from worker_service.prequantized import unpack_awq, unpack_columns, unpack_rows

NEW_TOKENS = 32
CASES = {  # name -> (method, group, sym, v1, the block format the linears get)
    "awq-g128": ("awq", 128, False, True, Q4_1),
    "awq-g32": ("awq", 32, False, True, Q4_1),
    "gptq-g64-asym-v1": ("gptq", 64, False, True, Q4_1),
    "gptq-g128-sym-v1": ("gptq", 128, True, True, Q4_0),
    "gptq-g32-sym-v2": ("gptq", 32, True, False, Q4_0),
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


def greedy(model_dir: Path, **kwargs: Any) -> tuple[list[list[int]], list[Linear]]:
    """Tessera's greedy tokens of the eight prompts (float32) and the model's linears."""
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory="64MiB", max_num_seqs=8,
              **kwargs)  # fmt: skip
    try:
        linears = [m for m in llm.worker.runner.model.modules() if isinstance(m, Linear)]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(eight_prompts(), params)
        return [list(o.outputs[0].token_ids) for o in outs], linears
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf_over_the_dequantized_weights(
    case: str, tiny_llama: Path, tmp_path: Path
) -> None:
    method, group, sym, v1, block_format = CASES[case]
    reference = write_quantized(tiny_llama, tmp_path / case, method, group, sym=sym, v1=v1)
    ours, linears = greedy(tmp_path / case)
    layers = [m for m in linears if m is not linears[-1]]  # the LM head stays float
    assert layers and all(m.quant is not None and m.quant.ggml_type == block_format for m in layers)
    theirs = hf_greedy_with(hf_with_weights(tiny_llama, reference), eight_prompts(), NEW_TOKENS)
    assert ours == theirs


def test_unpacking_inverts_the_published_packing() -> None:
    values = torch.randint(0, 16, (16, 64), dtype=torch.int32)  # [rows, cols]
    awq = torch.zeros(16, 8, dtype=torch.int32)
    plain = torch.zeros(16, 8, dtype=torch.int32)
    rows = torch.zeros(2, 64, dtype=torch.int32)
    for i, order in enumerate([0, 2, 4, 6, 1, 3, 5, 7]):
        awq |= values[:, order::8] << (4 * i)
        plain |= values[:, i::8] << (4 * i)
        rows |= values[i::8] << (4 * i)
    assert torch.equal(unpack_awq(awq), values)
    assert torch.equal(unpack_columns(plain), values)
    assert torch.equal(unpack_rows(rows), values)


BAD = {
    "method": ({"quant_method": "bitsandbytes", "bits": 4}, "quant_method 'bitsandbytes'"),
    "bits": ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with 8 bits"),
    "group": ({"quant_method": "awq", "bits": 4, "group_size": 16}, "group_size 16"),
    "gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    "format": (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
        "checkpoint_format 'marlin'",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_an_unsupported_quantization_config_is_refused_naming_the_file(
    case: str, tiny_llama: Path, tmp_path: Path
) -> None:
    config, message = BAD[case]
    write_quantized(tiny_llama, tmp_path, "gptq", 128, config=config)
    with pytest.raises(ValueError, match=message) as error:
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="64MiB")
    assert str(tmp_path / "config.json") in str(error.value)


def test_act_order_g_idx_is_refused_naming_the_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    write_quantized(tiny_llama, tmp_path, "gptq", 32, sym=True)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.g_idx"
    order = torch.randperm(len(tensors[name]), generator=torch.Generator().manual_seed(0))
    tensors[name] = (order // 32).to(torch.int32)  # act-order: groups of scattered inputs
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.g_idx .*act-order"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="64MiB")


def test_quantization_flags_must_match_the_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    write_quantized(tiny_llama, tmp_path, "awq", 64)
    for flag in ("int8", "int4", "gptq"):
        with pytest.raises(ValueError, match=f"awq checkpoint, already quantized.*{flag}"):
            LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="64MiB", quantization=flag)
    with pytest.raises(ValueError, match="has no quantization_config"):
        LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="64MiB", quantization="awq")
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["bits"] == 4


def test_awq_qwen2_keeps_its_float_qkv_biases(tmp_path: Path, default_model_dir: Path) -> None:
    """Qwen2's q/k/v biases stay float next to the fused Q4 qkv blocks."""
    src = save_family("qwen2", tmp_path / "float", default_model_dir)
    reference = write_quantized(src, tmp_path / "awq", "awq", 32)
    ours, _ = greedy(tmp_path / "awq")
    assert ours == hf_greedy_with(hf_with_weights(src, reference), eight_prompts(), NEW_TOKENS)
