"""M-RoPE positions (worker_service.mrope) against HF's Qwen2VLModel.get_rope_index, and
the errors for image inputs whose grid does not fit their placeholders."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from services.types import MultiModalInput
from worker_service.mrope import mrope_positions, step_positions

PAD, TEXT = 9, 1
MERGE = 2


def _hf_rope_index(ids: list[int], grids: list[list[int]]) -> tuple[np.ndarray, int]:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    model: Any = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE))
    )
    model.get_vision_position_ids = functools.partial(Qwen2VLModel.get_vision_position_ids, model)
    input_ids: Any = torch.tensor([ids])
    rope_index: Any = Qwen2VLModel.get_rope_index  # (called on a stand-in model)
    positions, delta = rope_index(
        model,
        input_ids,
        mm_token_type_ids=(input_ids == PAD).int(),
        image_grid_thw=torch.tensor(grids),
    )
    return positions[:, 0].numpy(), int(delta[0, 0])


def _prompt(layout: list[Any]) -> tuple[list[int], list[MultiModalInput], list[list[int]]]:
    """layout: ints (text runs) and grids [t, h, w] (an image) -> ids, items, grids."""
    ids: list[int] = []
    items, grids = [], []
    for part in layout:
        if isinstance(part, int):
            ids += [TEXT] * part
            continue
        n = part[0] * part[1] * part[2] // MERGE**2
        items.append(MultiModalInput("image", len(ids), n, "h", None, part))
        grids.append(part)
        ids += [PAD] * n
    return ids, items, grids


LAYOUTS = [
    [3, [1, 8, 10], 4],  # text, image, text
    [[1, 4, 16], 2, [1, 6, 6], 5],  # an image first; two images of different grids
    [2, [1, 4, 4], 1, [1, 2, 8]],  # one token between two images, an image last
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_positions_equal_hf_get_rope_index(layout: list[Any]) -> None:
    ids, items, grids = _prompt(layout)
    table, delta = _hf_rope_index(ids, grids)
    ours = mrope_positions(len(ids), items, MERGE)
    np.testing.assert_array_equal(ours.table, table)
    assert ours.delta == delta
    # decode tokens: every axis at position + delta
    after = np.arange(len(ids), len(ids) + 3)
    np.testing.assert_array_equal(ours.of(after), np.broadcast_to(after + ours.delta, (3, 3)))


def test_step_positions_pick_each_requests_rows() -> None:
    ids, items, _ = _prompt([3, [1, 4, 4], 2])
    mrope = mrope_positions(len(ids), items, MERGE)
    # request 0: text only, positions 5..6; request 1: prompt positions 2..7 (a chunk)
    flat = torch.tensor([5, 6, 2, 3, 4, 5, 6, 7])
    out = step_positions(flat, [0, 2, 8], [None, mrope]).numpy()
    np.testing.assert_array_equal(out[:, :2], [[5, 6]] * 3)
    np.testing.assert_array_equal(out[:, 2:], mrope.table[:, 2:8])


def test_an_image_without_its_grid_is_refused() -> None:
    item = MultiModalInput("image", 1, 4, "h", None)
    with pytest.raises(ValueError, match="grid_thw"):
        mrope_positions(6, [item], MERGE)


def test_a_grid_that_does_not_fit_the_placeholders_is_refused() -> None:
    item = MultiModalInput("image", 1, 5, "h", None, [1, 4, 4])  # 4 tokens, not 5
    with pytest.raises(ValueError, match="4 tokens, not 5"):
        mrope_positions(8, [item], MERGE)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"mrope_section": (2, 3, 2)}, "must sum to 8"),
        ({"rope_type": "dynamic", "factor": 2.0, "mrope_section": (2, 3, 3)}, "not implemented"),
    ],
)
def test_mrope_configs_it_cannot_serve_are_refused(rope: dict[str, Any], message: str) -> None:
    from worker_service.models.config import RopeConfig
    from worker_service.models.rope import MRotaryEmbedding

    with pytest.raises(ValueError, match=message):
        MRotaryEmbedding(16, 64, RopeConfig(**rope))
