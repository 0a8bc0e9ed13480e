"""HF `generate` on a VLM directory: the reference the Tessera outputs must equal."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import torch
from PIL import Image


@cache
def _hf(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText

    from gateway.hf_processor import load_hf_processor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = json.loads((model_dir / "config.json").read_text())
    return model, load_hf_processor(model_dir, config)  # (Qwen2-VL's without torchvision)


def hf_vlm_greedy(
    model_dir: Path,
    text: str,
    images: list[Image.Image],
    max_new_tokens: int,
    add_special_tokens: bool = True,
) -> list[int]:
    """Greedy tokens of HF generate for `text` with `images`, never stopping at EOS."""
    model, processor = _hf(model_dir)
    inputs = processor(
        text=[text],
        images=images or None,
        return_tensors="pt",
        add_special_tokens=add_special_tokens,
    )
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return list(out[0, inputs["input_ids"].shape[1] :].tolist())


def hf_chat_prompt(model_dir: Path, chat: list[dict[str, Any]]) -> str:
    """The chat rendered by the model's own processor, image_url parts as {"type": "image"}."""
    turns = [
        {
            **m,
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        if isinstance(m["content"], list)
        else m
        for m in chat
    ]
    processor = _hf(model_dir)[1]
    return str(processor.apply_chat_template(turns, add_generation_prompt=True))
