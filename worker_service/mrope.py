"""M-RoPE positions (Qwen2-VL): each prompt token's (temporal, height, width) position, as
HF's `get_rope_index` computes it for images.

Text runs count up on all three axes from where the previous run ended; an image's tokens
(t, h / merge, w / merge of them) take start + their grid coordinates, and the text after
it starts at start + max(h, w) / merge. Past the prompt every axis is
`position + delta`, delta = max(prompt positions) + 1 - prompt length (HF's
rope_deltas), so decoded, preempted-and-recomputed and draft tokens need no table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.types import MultiModalInput


@dataclass(frozen=True)
class MRopePositions:
    """One request's M-RoPE positions: its prompt's table and the delta after it."""

    table: np.ndarray  # [3, prompt_len] int64
    delta: int

    def of(self, positions: np.ndarray) -> np.ndarray:
        """1D positions [n] (token indices) -> [3, n] M-RoPE positions."""
        inside = positions < self.table.shape[1]
        out = np.broadcast_to(positions + self.delta, (3, len(positions))).copy()
        out[:, inside] = self.table[:, positions[inside]]
        return out


def image_positions(grid_thw: list[int], merge: int, start: int) -> np.ndarray:
    """[3, t * h * w / merge^2]: an image's token positions from `start` (t, h, w order)."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(prompt_len: int, items: list[MultiModalInput], merge: int) -> MRopePositions:
    """The positions of a prompt whose image items cover [offset, offset + length) each
    (in order); ValueError when an item's grid does not give its token count."""
    table = np.empty((3, prompt_len), dtype=np.int64)
    pos = cursor = 0  # next prompt index / next position value
    for item in items:
        if len(item.grid_thw) != 3:
            raise ValueError("a Qwen2-VL image input needs its grid_thw (t, h, w)")
        text = item.offset - pos
        table[:, pos : item.offset] = np.arange(text) + cursor
        cursor += text
        image = image_positions(list(item.grid_thw), merge, cursor)
        if image.shape[1] != item.length:
            raise ValueError(
                f"the image at [{item.offset}, {item.offset + item.length}) has grid "
                f"{list(item.grid_thw)}, i.e. {image.shape[1]} tokens, not {item.length}"
            )
        table[:, item.offset : item.offset + item.length] = image
        cursor += max(item.grid_thw[1], item.grid_thw[2]) // merge
        pos = item.offset + item.length
    table[:, pos:] = np.arange(prompt_len - pos) + cursor
    delta = int(table.max()) + 1 - prompt_len if prompt_len else 0
    return MRopePositions(table, delta)


def step_positions(
    positions: torch.Tensor,
    query_start_loc: list[int],
    per_request: list[MRopePositions | None],
) -> torch.Tensor:
    """A step's 1D positions [num_tokens] -> [3, num_tokens] on the same device: each
    request's rows (query_start_loc) through its M-RoPE positions (None: text only)."""
    flat = positions.cpu().numpy()
    out = np.broadcast_to(flat, (3, len(flat))).copy()
    for i, mrope in enumerate(per_request):
        if mrope is not None:
            a, b = query_start_loc[i], query_start_loc[i + 1]
            out[:, a:b] = mrope.of(flat[a:b])
    return torch.from_numpy(out).to(positions.device)
