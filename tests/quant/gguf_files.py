"""GGUF files made in the tests from the default model's (no network): the same model
re-quantized to another block format, a tiny random Llama in the K-quants (the gguf package
dequantizes them but does not quantize them: `quantize_k` and `quantize_q6_k` here), and
broken files for the error paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from services.default_model import gguf_path

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# The tiny Llama: sizes whole super-blocks of 256; the default model's tokenizer and vocab.
TINY: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152}  # fmt: skip


def requantize(
    out: Path, qtype: str, *, architecture: str = "llama", broken_type: bool = False
) -> Path:
    """The default GGUF with every block tensor re-quantized to `qtype`; `architecture` names
    another architecture; `broken_type` writes the first block tensor as Q4_K bytes."""
    reader = gguf.GGUFReader(gguf_path())
    writer = _writer_with_metadata(out, reader, architecture, {})
    target = gguf.GGMLQuantizationType[qtype]
    for i, tensor in enumerate(reader.tensors):
        if tensor.tensor_type.name not in BLOCK_TYPES:
            writer.add_tensor(tensor.name, np.array(tensor.data))
            continue
        values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
        kind = gguf.GGMLQuantizationType.Q2_K if broken_type and i < 2 else target
        if kind == gguf.GGMLQuantizationType.Q2_K:
            rows, cols = values.shape
            raw = np.zeros((rows, cols // 256 * 84), dtype=np.uint8)
        else:
            raw = gguf.quants.quantize(values, kind)
        writer.add_tensor(tensor.name, raw, raw_dtype=kind)
    return _close(writer, out)


def _writer_with_metadata(
    out: Path, reader: gguf.GGUFReader, architecture: str, override: dict[str, int]
) -> gguf.GGUFWriter:
    """A writer with the default GGUF's metadata (tokenizer, chat template, hyperparameters;
    `override`: `llama.` keys replaced) under `architecture`'s name."""
    writer = gguf.GGUFWriter(out, architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = name.replace("llama.", f"{architecture}.", 1)
        sub = field.types[1] if len(field.types) > 1 else None
        value = override.get(name, field.contents())
        writer.add_key_value(key, value, field.types[0], sub)
    return writer


def _close(writer: gguf.GGUFWriter, out: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def tiny_llama(out: Path, types: dict[str, str], seed: int = 0) -> Path:
    """A random Llama (TINY sizes, tied embedding) as a GGUF file: `types` names the block
    format of each tensor kind (`attn_q` ... `ffn_down`, `token_embd`; the rest F32), q and k
    permuted as llama.cpp's converter does. transformers reads it back dequantized."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY, tie_word_embeddings=True)  # only its tensors are written
    model = LlamaForCausalLM(config)
    override = {"llama.block_count": TINY["num_hidden_layers"],
                "llama.embedding_length": TINY["hidden_size"],
                "llama.feed_forward_length": TINY["intermediate_size"],
                "llama.attention.head_count": TINY["num_attention_heads"],
                "llama.attention.head_count_kv": TINY["num_key_value_heads"]}  # fmt: skip
    writer = _writer_with_metadata(out, gguf.GGUFReader(gguf_path()), "llama", override)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, TINY["num_hidden_layers"])
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        assert name is not None, hf_name
        values = param.float().numpy()
        kind = name.split(".")[-2]
        if kind in ("attn_q", "attn_k"):
            heads = TINY["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
            values = _permute(values, heads)
        if kind not in types:
            writer.add_tensor(name, values)
            continue
        qtype = gguf.GGMLQuantizationType[types[kind]]
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    return _close(writer, out)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, rows (half, i) -> (i, half)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def quantize(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """[rows, cols] float32 -> [rows, bytes] uint8 blocks of `qtype`."""
    rows = values.shape[0]
    blocks = values.astype(np.float32).reshape(-1, 256)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(blocks).reshape(rows, -1)
    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        bits = 4 if qtype == gguf.GGMLQuantizationType.Q4_K else 5
        return quantize_k(blocks, bits).reshape(rows, -1)
    return gguf.quants.quantize(values, qtype)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def quantize_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """[n, 256] -> Q4_K (`bits` 4) or Q5_K (5) blocks [n, 144 or 176]: per group of 32,
    w ~ d sc q - dmin mn with 6-bit sc, mn (a plain min/max fit, not llama.cpp's search)."""
    n, top = blocks.shape[0], (1 << bits) - 1
    x = blocks.reshape(n, 8, 32)
    mins = np.maximum(-x.min(axis=2), 0)  # [n, 8]: w >= -mn
    scales = (x.max(axis=2) + mins) / top
    d = (scales.max(axis=1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(axis=1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(_divide(scales, d.astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_divide(mins, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[..., None]
    offset = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.round(_divide(x + offset, np.broadcast_to(step, x.shape))), 0, top)
    q = q.astype(np.uint8)  # [n, 8, 32]
    packed = np.concatenate(
        [(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1,
    )  # fmt: skip
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(n, 128)
    parts = [d.view(np.uint8), dmin.view(np.uint8), packed]
    if bits == 5:  # bit 4 of group j's value i: bit j of qh[i]
        parts.append(
            ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)
        )
    return np.concatenate([*parts, qs], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> Q6_K blocks [n, 210]: per 16 weights an int8 scale, values -32..31."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 16, 16)
    scales = np.abs(x).max(axis=2) / 31  # [n, 16]
    d = (scales.max(axis=1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(_divide(scales, d.astype(np.float32))), 0, 127).astype(np.int8)
    step = np.broadcast_to((d.astype(np.float32) * sc)[..., None], x.shape)
    q = (np.clip(np.round(_divide(x, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    by64 = q.reshape(n, 2, 2, 64)  # element t of a half: (t / 64, t % 64)
    ql = (by64[:, :, 0] & 15) | ((by64[:, :, 1] & 15) << 4)
    by32 = (q.reshape(n, 2, 4, 32) >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = by32.sum(axis=2, dtype=np.uint8)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8)], axis=1
    )


def truncated(out: Path) -> Path:
    """The default GGUF cut off in the middle of its tensor data."""
    data = gguf_path().read_bytes()
    out.write_bytes(data[: len(data) // 2])
    return out
