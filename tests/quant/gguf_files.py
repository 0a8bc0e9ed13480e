"""GGUF files made in the tests from the default model's (no network): the same model
re-quantized to another block format, and broken files for the error paths."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from services.default_model import gguf_path

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def requantize(
    out: Path, qtype: str, *, architecture: str = "llama", broken_type: bool = False
) -> Path:
    """The default GGUF with every block tensor re-quantized to `qtype`; `architecture` names
    another architecture; `broken_type` writes the first block tensor as Q4_K bytes."""
    reader = gguf.GGUFReader(gguf_path())
    writer = gguf.GGUFWriter(out, architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = name.replace("llama.", f"{architecture}.", 1)
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    target = gguf.GGMLQuantizationType[qtype]
    for i, tensor in enumerate(reader.tensors):
        if tensor.tensor_type.name not in BLOCK_TYPES:
            writer.add_tensor(tensor.name, np.array(tensor.data))
            continue
        values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
        kind = gguf.GGMLQuantizationType.Q4_K if broken_type and i < 2 else target
        if kind == gguf.GGMLQuantizationType.Q4_K:
            rows, cols = values.shape
            raw = np.zeros((rows, cols // 256 * 144), dtype=np.uint8)
        else:
            raw = gguf.quants.quantize(values, kind)
        writer.add_tensor(tensor.name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def truncated(out: Path) -> Path:
    """The default GGUF cut off in the middle of its tensor data."""
    data = gguf_path().read_bytes()
    out.write_bytes(data[: len(data) // 2])
    return out
