"""VLM checkpoint layouts: the old and the transformers >= 4.52 names map to one model."""

from __future__ import annotations

import pytest

from worker_service.models.idefics3 import Idefics3ForConditionalGeneration
from worker_service.models.llava import LlavaForConditionalGeneration

LLAVA = [
    # (old layout, new layout, parameter)
    ("language_model.model.layers.0.mlp.up_proj.weight",
     "model.language_model.layers.0.mlp.up_proj.weight", "layers.0.mlp.up_proj.weight"),
    ("language_model.lm_head.weight", "lm_head.weight", "lm_head.weight"),
    ("language_model.model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
     "embed_tokens.weight"),
    ("vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight",
     "model.vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight",
     "vision_tower.encoder.layers.1.self_attn.q_proj.weight"),
    ("multi_modal_projector.linear_1.bias", "model.multi_modal_projector.linear_1.bias",
     "multi_modal_projector.linear_1.bias"),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new", "param"), LLAVA)
def test_llava_layouts(old: str, new: str, param: str) -> None:
    assert LlavaForConditionalGeneration.checkpoint_name(old) == param
    assert LlavaForConditionalGeneration.checkpoint_name(new) == param


def test_position_ids_buffers_are_skipped() -> None:
    name = "vision_tower.vision_model.embeddings.position_ids"
    assert LlavaForConditionalGeneration.checkpoint_name(name) == ""


def test_idefics3_layout() -> None:
    rename = Idefics3ForConditionalGeneration.checkpoint_name
    assert rename("model.text_model.layers.0.self_attn.q_proj.weight") == (
        "layers.0.self_attn.q_proj.weight"
    )
    assert (
        rename("model.vision_model.post_layernorm.weight") == "vision_model.post_layernorm.weight"
    )
    assert rename("model.connector.modality_projection.proj.weight") == (
        "connector.modality_projection.proj.weight"
    )
    assert rename("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("model", [LlavaForConditionalGeneration, Idefics3ForConditionalGeneration])
def test_vision_language_models_refuse_tensor_parallelism(model: type) -> None:
    from worker_service.parallel import TPGroup

    with pytest.raises(ValueError, match="does not split vision-language models"):
        model(None, None, TPGroup(rank=0, size=2))
