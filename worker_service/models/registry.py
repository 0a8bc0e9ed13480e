"""config.json `architectures` -> model class."""

from __future__ import annotations

from worker_service.models.idefics3 import Idefics3ForConditionalGeneration
from worker_service.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from worker_service.models.llava import LlavaForConditionalGeneration
from worker_service.models.moe_models import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class serving `architecture`; ValueError naming the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported model architecture {architecture!r} (supported: {supported})"
        ) from None
