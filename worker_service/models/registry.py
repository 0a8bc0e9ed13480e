"""config.json `architectures` -> model class."""

from __future__ import annotations

from worker_service.models.config import ModelArchConfig
from worker_service.models.dense import (
    MistralForCausalLM,
    Phi3ForCausalLM,
    SmolLM3ForCausalLM,
)
from worker_service.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from worker_service.models.idefics3 import Idefics3ForConditionalGeneration
from worker_service.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from worker_service.models.llava import LlavaForConditionalGeneration
from worker_service.models.moe_models import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from worker_service.models.qwen2_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


def check_features(cls: type[LlamaForCausalLM], cfg: ModelArchConfig) -> None:
    """ValueError naming each config feature (config.json field) `cls` does not implement:
    a model is refused rather than served with the feature silently ignored."""
    missing = [f for f in cfg.features if f not in cls.supported_features]
    if missing:
        raise ValueError(
            f"{cfg.architecture}: config.json sets {', '.join(missing)}, which this server does "
            "not implement for this architecture (refusing rather than ignoring it)"
        )


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class serving `architecture`; ValueError naming the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported model architecture {architecture!r} (supported: {supported})"
        ) from None
