"""The HF processor of a vision-language model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_hf_processor(model_dir: Path, config: dict[str, Any]) -> Any:
    """AutoProcessor of `model_dir`. Qwen2-VL's processor also loads a video processor,
    which needs torchvision; without it the processor is built for images only (videos
    are not served)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(model_dir))
    except ImportError:
        if config.get("model_type") not in ("qwen2_vl", "qwen2_5_vl"):
            raise
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return _qwen_image_processor_class(config["model_type"])(
        image_processor=AutoImageProcessor.from_pretrained(str(model_dir)),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )


def _qwen_image_processor_class(model_type: str) -> Any:
    """HF's Qwen2-VL (or Qwen2.5-VL) processor class, accepting no video processor."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

    base: Any = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen2VLProcessor

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, name: str, argument: Any) -> Any:
            if name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(name, argument)

    return ImagesOnly
