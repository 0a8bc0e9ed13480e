"""The embedded default model converts, loads with transformers and answers correctly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.default_model import resolve_model, served_name


def test_converted_directory_is_a_plain_checkpoint(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (default_model_dir / "model.safetensors").stat().st_size > 500e6  # float32 weights


def test_chat_template_renders_two_turns(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(default_model_dir)
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name a color."},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.count("<|im_start|>user\n") == 2
    assert "<|im_start|>assistant\nHello! How can I help?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


@pytest.mark.slow
def test_greedy_generate_knows_the_capital_of_france(default_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_model_paths_resolve(tmp_path: Path, default_model_dir: Path) -> None:
    assert resolve_model("default") == default_model_dir
    assert resolve_model(str(default_model_dir)) == default_model_dir
    assert served_name("default") == "SmolLM2-135M-Instruct"
    with pytest.raises(FileNotFoundError, match="neither a model directory"):
        resolve_model(str(tmp_path))
