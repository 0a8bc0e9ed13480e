"""Acceptance 4: the worker's pixel tensor lives inside the mapped shm segment (no copy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import worker_service.multimodal as worker_mm
from benchmarks.tiny_vlm import sample_image
from services.tensor_handles import MappedTensor, export_tensor, map_tensor
from services.types import SamplingParams


def test_map_tensor_is_a_view_of_the_segment() -> None:
    source = torch.randn(3, 32, 32)
    with export_tensor(source, "shm") as exported:
        mapped = map_tensor(exported.handle)
        tensor = mapped.tensor
        assert tensor is not None and torch.equal(tensor, source)
        start, end = mapped.mapping
        assert start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= end
        source_ptr = source.data_ptr()
        assert not start <= source_ptr < end  # the producer's tensor is elsewhere
        del tensor
        mapped.close()
        mapped.close()  # twice is harmless
        assert mapped.closed


def test_inline_handle_still_opens() -> None:
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with export_tensor(source, "inline") as exported, map_tensor(exported.handle) as mapped:
        assert mapped.tensor is not None and torch.equal(mapped.tensor, source)


def test_worker_encodes_straight_from_the_mapping(
    tiny_llava_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tessera import LLM

    opened: list[MappedTensor] = []
    seen: list[tuple[int, int, int, int]] = []  # (pixel ptr, nbytes, mapping start, end)

    def recording_map(handle: Any) -> MappedTensor:
        opened.append(map_tensor(handle))
        return opened[-1]

    monkeypatch.setattr(worker_mm, "map_tensor", recording_map)
    llm = LLM(str(tiny_llava_dir), dtype="float32", kv_cache_memory="16MiB")
    encode = llm.worker.runner.mm.encoder
    assert encode is not None

    def recording_encode(pixels: torch.Tensor) -> list[torch.Tensor]:
        seen.append((pixels.data_ptr(), pixels.nbytes, *opened[-1].mapping))
        return encode(pixels)

    monkeypatch.setattr(llm.worker.runner.mm, "encoder", recording_encode)
    try:
        images = [sample_image(1), sample_image(2)]
        llm.generate(
            {"prompt": "<image> and <image>", "multi_modal_data": {"image": images}},
            SamplingParams(temperature=0, max_tokens=2),
        )
    finally:
        llm.shutdown()
    assert len(seen) == 2
    for ptr, nbytes, start, end in seen:
        assert start <= ptr and ptr + nbytes <= end
    assert opened and all(m.closed for m in opened)  # closed after encoding
