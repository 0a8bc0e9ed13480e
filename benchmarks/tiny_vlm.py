"""Tiny random-weight vision-language models saved as HF directories (no download).

The tokenizer is the default model's (SmolLM2) with the image token added; the chat
template is SmolLM2's ChatML, extended to render image parts as the image token.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image

IMAGE_TOKEN = "<image>"

# ChatML that renders {"type": "image"} / {"type": "image_url"} parts as the image token.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}<image>\n{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(default_model_dir: Path, chat_template: str = CHAT_TEMPLATE) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = chat_template
    return tok


def _text_config(tok: Any) -> Any:
    """The tiny Llama language model of both VLMs."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )


def build_tiny_llava(
    out_dir: Path,
    default_model_dir: Path,
    seed: int = 0,
    image_size: int = 32,
    patch: int = 8,
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """A random LlavaForConditionalGeneration (tiny CLIP + tiny Llama) + its processor;
    (image_size / patch) ** 2 image tokens per image."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = _tokenizer(default_model_dir, chat_template)
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch,
        projection_dim=32,
    )
    text = _text_config(tok)
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # random init is tiny; widen it so outputs depend on the image
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    model.save_pretrained(out_dir)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=patch,
        vision_feature_select_strategy="default",
        chat_template=chat_template,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(out_dir)
    return out_dir


def sample_image(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    """A reproducible random RGB image."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def build_tiny_idefics3(
    out_dir: Path, default_model_dir: Path, seed: int = 0, chat_template: str = CHAT_TEMPLATE
) -> Path:
    """A random Idefics3ForConditionalGeneration (tiny SigLIP-style encoder, pixel-shuffle
    connector, tiny Llama) + its processor, which tiles large images (SmolVLM's layout)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    tok = _tokenizer(default_model_dir, chat_template)
    tags = ["<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tok.add_tokens(tags)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
        ),
        tokenizer=tok,
        image_seq_len=4,  # (32 / 8) ** 2 patches / scale_factor ** 2
        chat_template=chat_template,
    )
    text = _text_config(tok)
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 32,
        "patch_size": 8,
    }
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision,
        scale_factor=2,
        image_token_id=processor.image_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


# Each tiny VLM by name: builder(out_dir, default_model_dir, seed=0, chat_template=...) -> dir.
BUILDERS: dict[str, Callable[..., Path]] = {
    "llava": build_tiny_llava,
    "idefics3": build_tiny_idefics3,
}
