"""The quality benchmark: its perplexity equals HF's over the same windows (float32, the
default model), and its rows, ratios and table."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from benchmarks import quality
from benchmarks.report import cpu_info
from tessera import LLM
from tests.hf_reference import hf_model


def test_perplexity_equals_hf_over_the_same_windows(default_model_dir: Path) -> None:
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_num_seqs=4)
    try:
        ids = llm.tokenizer.encode(quality.TEXT.read_text(), False)[:200]
        ours = quality.perplexity(llm, ids, window=64)
    finally:
        llm.shutdown()
    model = hf_model(default_model_dir)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, 64):
            window = torch.tensor([ids[start : start + 64]])
            logprobs = model(window).logits[0, :-1].float().log_softmax(-1)
            nll -= logprobs.gather(1, window[0, 1:, None]).sum().item()
            count += window.shape[1] - 1
    assert math.isclose(ours, math.exp(nll / count), rel_tol=1e-4)


def test_common_prefix() -> None:
    assert quality.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert quality.common_prefix([1, 2], [1, 2]) == 2 and quality.common_prefix([5], [6]) == 0


def test_rows_give_ratios_to_fp32_perplexity_and_bf16_speed() -> None:
    results = [
        {"format": "fp32", "perplexity": 20.0},
        {"format": "bf16", "perplexity": 20.2},
        {"format": "int8", "perplexity": 21.0},
    ]
    speeds = {
        "fp32": {"b1_tok_s": 10.0, "b32_tok_s": 100.0, "weights_mb": 4.0},
        "bf16": {"b1_tok_s": 20.0, "b32_tok_s": 200.0, "weights_mb": 2.0},
        "int8": {"b1_tok_s": 30.0, "b32_tok_s": 100.0, "weights_mb": 1.0},
    }
    rows = {r["format"]: r for r in quality.rows(results, speeds)}
    assert math.isclose(rows["int8"]["ppl_vs_fp32"], 1.05)
    assert rows["int8"]["b1_vs_bf16"] == 1.5 and rows["int8"]["b32_vs_bf16"] == 0.5
    data = {"cpu": cpu_info(), "window": 512, "new_tokens": 32, "steps": 8, "repeats": 1,
            "text_tokens": 2057, "rows": list(rows.values())}  # fmt: skip
    text = quality.table(data)
    assert "CPU: " in text and "| int8 |" in text and "2057 tokens" in text


def test_a_quantized_kv_row_is_compared_with_its_model_dtype_cache() -> None:
    results = [
        {"format": "bf16", "perplexity": 20.0},
        {"format": "bf16-kv-int8", "perplexity": 20.1},
        {"format": "fp32-kv-int8", "perplexity": 19.0},  # its auto row is missing
    ]
    speeds = {str(r["format"]): {"b1_tok_s": 1.0, "b32_tok_s": 1.0} for r in results}
    rows = {r["format"]: r for r in quality.rows(results, speeds)}
    assert math.isclose(rows["bf16-kv-int8"]["ppl_vs_kv_auto"], 1.005)
    assert rows["bf16"]["ppl_vs_kv_auto"] is None and rows["fp32-kv-int8"]["ppl_vs_kv_auto"] is None
    assert quality.FORMATS["bf16-kv-fp8"] == ("bfloat16", "none", "fp8_e4m3")
