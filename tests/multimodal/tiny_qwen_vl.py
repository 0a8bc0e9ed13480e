"""Tiny random Qwen2-VL / Qwen2.5-VL directories (no download).

The tokenizer is the default model's with Qwen's vision tokens added; the image processor
has patch 4, merge 2 and a 256..2048 pixel budget, so smart_resize gives each image a few
8x8-pixel merged tokens and images of different sizes get different grids. The chat
template is ChatML rendering image parts as <|vision_start|><|image_pad|><|vision_end|>.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a prompt
MIN_PIXELS, MAX_PIXELS = 256, 2048

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vision_config(kind: str) -> dict[str, Any]:
    common = {"depth": 2, "num_heads": 4, "patch_size": 4, "spatial_merge_size": 2}
    if kind == "qwen2_vl":
        return {**common, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
    # Qwen2.5-VL: windowed attention (one 16-pixel window = 2x2 merged tokens), block 1 full
    return {
        **common,
        "hidden_size": 32,
        "intermediate_size": 48,
        "out_hidden_size": 64,
        "window_size": 16,
        "fullatt_block_indexes": [1],
    }


def build_tiny_qwen_vl(
    out_dir: Path, default_model_dir: Path, kind: str = "qwen2_vl", seed: int = 0
) -> Path:
    """A random Qwen2VLForConditionalGeneration (kind "qwen2_vl") or
    Qwen2_5_VLForConditionalGeneration ("qwen2_5_vl") with its processor files."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
    }
    config_cls, model_cls = _classes(kind)
    config = config_cls(
        text_config=text,
        vision_config=_vision_config(kind),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # random init is tiny; widen it so outputs depend on the image
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=4, merge_size=2
    ).save_pretrained(out_dir)
    processor = "Qwen2_5_VLProcessor" if kind == "qwen2_5_vl" else "Qwen2VLProcessor"
    (out_dir / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
    return out_dir


def _classes(kind: str) -> tuple[Any, Any]:
    if kind == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        return Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration


def to_flat_layout(src: Path, dst: Path) -> Path:
    """A copy of a tiny Qwen VL directory in the Hub's older layout (Qwen2-VL-2B-Instruct's):
    the text config flat at the top with `rope_scaling: {"type": "mrope", ...}`, tensors
    named model.layers.* / visual.* / lm_head.*."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in text.items() if k not in ("model_type", "layer_types")}
    flat["rope_theta"] = rope["rope_theta"]
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    (dst / "config.json").write_text(json.dumps({**config, **flat}))
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {
        name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t
        for name, t in tensors.items()
    }
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
