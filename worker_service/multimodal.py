"""Multimodal inputs on the worker: open each image's handle without copying, run the
vision encoder once per image, and scatter the embeddings into the step's input embeddings.

An item (`MultiModalInput`) covers prompt positions [offset, offset + length); its
embedding rows go, in order, to the positions inside that range that hold the model's
image token (LLaVA's range is all image tokens; Idefics3 interleaves layout tokens).
Embeddings are cached by content hash until every request that needs them has computed
past its range (chunked prefill may split a range over several steps), and dropped on
finish, preemption or abort.

M-RoPE models (Qwen2-VL) also get each image request's 3D positions (worker_service.mrope),
computed when the request arrives (again after a preemption) and kept until it ends.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.tensor_handles import map_tensor
from services.types import MultiModalInput
from worker_service.input_batch import InputBatch, RequestState, StepBatch
from worker_service.models.llama import LlamaForCausalLM
from worker_service.mrope import MRopePositions, mrope_positions, step_positions

Encoder = Callable[..., list[torch.Tensor]]  # (pixels[, grid_thw]) -> rows per image


class MultiModalInputs:
    """Pending items per request and the encoder cache of one worker."""

    def __init__(self, model: LlamaForCausalLM, input_batch: InputBatch) -> None:
        self.model = model
        self.encoder: Encoder | None = getattr(model, "encode_images", None)
        self.image_token_id: int = getattr(model, "image_token_id", -1)
        self.input_batch = input_batch
        self.pending: dict[str, list[MultiModalInput]] = {}
        self.cache: dict[str, torch.Tensor] = {}  # content hash -> [num_embeds, hidden]
        self.uses_mrope: bool = getattr(model, "uses_mrope", False)
        self.mrope: dict[str, MRopePositions] = {}  # requests with images, M-RoPE models

    def add(self, req_id: str, items: list[MultiModalInput], num_computed: int) -> None:
        """Track a new request's items not yet computed; ValueError for a text-only model."""
        if items and self.encoder is None:
            raise ValueError("this model takes no image inputs")
        if items and self.uses_mrope:
            prompt_len = self.input_batch.requests[req_id].prompt_len
            merge = int(getattr(self.model, "spatial_merge_size", 1))
            self.mrope[req_id] = mrope_positions(prompt_len, items, merge)
        left = [it for it in items if it.offset + it.length > num_computed]
        if left:
            self.pending[req_id] = left

    def remove(self, req_id: str) -> None:
        """Forget a finished, preempted or failed request."""
        self.mrope.pop(req_id, None)
        if self.pending.pop(req_id, None) is not None:
            self._evict()

    def encode(
        self, order: list[RequestState], counts: list[int], errors: dict[str, str]
    ) -> tuple[list[RequestState], list[int]]:
        """Encode the images this step's chunks reach; a request whose image cannot be
        opened or encoded is dropped from the step with its error in `errors`."""
        if not self.pending:
            return order, counts
        kept: list[tuple[RequestState, int]] = []
        for state, n in zip(order, counts, strict=True):
            try:
                for item in self._overlapping(state, n):
                    self._ensure_encoded(state, item)
                kept.append((state, n))
            except ValueError as exc:
                errors[state.req_id] = str(exc)
                self.input_batch.remove(state.req_id)
                self.remove(state.req_id)
        return [s for s, _ in kept], [n for _, n in kept]

    def input_embeds(self, step: StepBatch) -> torch.Tensor | None:
        """[num_tokens, hidden] embeddings with image rows scattered in, or None when no
        scheduled chunk touches an image (the model embeds the ids itself)."""
        if not self.pending:
            return None
        starts = step.meta.query_start_loc.tolist()
        scatter = [
            (starts[i] + dst, item, src)
            for i, state in enumerate(step.states)
            for item in self._overlapping(state, int(step.num_scheduled[i]))
            for dst, src in [self._rows(state, int(step.num_scheduled[i]), item)]
        ]
        if not scatter:
            return None
        embeds = self.model.embed_tokens(step.input_ids)  # [num_tokens, hidden]
        for dst, item, src in scatter:
            rows = self.cache[_key(item)]
            index = torch.as_tensor(dst, device=embeds.device)
            embeds.index_copy_(0, index, rows[torch.as_tensor(src)].to(embeds))
        return embeds

    def positions(self, step: StepBatch) -> torch.Tensor:
        """The step's positions for the model: [num_tokens], or [3, num_tokens] M-RoPE
        positions when a request with images is in the step."""
        if not self.mrope:
            return step.positions
        per_request = [self.mrope.get(state.req_id) for state in step.states]
        if not any(per_request):
            return step.positions
        starts = step.meta.query_start_loc.tolist()
        return step_positions(step.positions, starts, per_request)

    def advance(self, states: list[RequestState]) -> None:
        """After a step: drop items whose range every request has computed past."""
        for state in states:
            items = self.pending.get(state.req_id)
            if items is None:
                continue
            left = [it for it in items if it.offset + it.length > state.num_computed]
            if left:
                self.pending[state.req_id] = left
            else:
                del self.pending[state.req_id]
        self._evict()

    # ------------------------------------------------------------------ helpers
    def _overlapping(self, state: RequestState, n: int) -> list[MultiModalInput]:
        start, end = state.num_computed, state.num_computed + n
        return [
            it
            for it in self.pending.get(state.req_id, ())
            if it.offset < end and it.offset + it.length > start
        ]

    def _positions(self, state: RequestState, item: MultiModalInput) -> np.ndarray:
        """Offsets inside the item's range that take an embedding row, in order."""
        ids = self.input_batch.token_ids[state.row, item.offset : item.offset + item.length]
        return np.flatnonzero(ids == self.image_token_id)

    def _rows(
        self, state: RequestState, n: int, item: MultiModalInput
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rows of this request's chunk, embedding rows) for the part of `item` in the chunk."""
        pos = self._positions(state, item) + item.offset  # absolute prompt positions
        src = np.flatnonzero((pos >= state.num_computed) & (pos < state.num_computed + n))
        return pos[src] - state.num_computed, src

    def _ensure_encoded(self, state: RequestState, item: MultiModalInput) -> None:
        key = _key(item)
        if key in self.cache:
            return
        if item.tensor is None or self.encoder is None:
            raise ValueError("an image input without a tensor, or a model without an encoder")
        mapped = map_tensor(item.tensor)  # a view of the producer's segment, no copy
        try:
            pixels = mapped.tensor
            assert pixels is not None
            device = self.model.embed_tokens.weight.device
            grid = {}
            if item.grid_thw:  # Qwen2-VL: the patch grid travels with the pixels
                grid["grid_thw"] = torch.tensor([list(item.grid_thw)], device=device)
            with torch.inference_mode():
                rows = self.encoder(pixels.to(device).unsqueeze(0), **grid)[0]  # [embeds, hidden]
            del pixels
        finally:
            mapped.close()
        expected = len(self._positions(state, item))
        if rows.shape[0] != expected:
            raise ValueError(
                f"the image at [{item.offset}, {item.offset + item.length}) has {expected} "
                f"image tokens but its encoder gives {rows.shape[0]} embeddings"
            )
        self.cache[key] = rows

    def _evict(self) -> None:
        live = {_key(it) for items in self.pending.values() for it in items}
        for key in [k for k in self.cache if k not in live]:
            del self.cache[key]


def _key(item: MultiModalInput) -> str:
    return item.content_hash or f"handle:{id(item.tensor)}"
