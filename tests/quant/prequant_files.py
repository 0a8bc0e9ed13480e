"""Tiny AWQ and GPTQ checkpoints written in-process from a float HF checkpoint, packed the way
AutoAWQ (GEMM) and AutoGPTQ / GPTQModel publish them, and their weights dequantized
independently with the published formulas (the HF reference runs those weights).

Layouts (w[out, in] = (q - z) * s; round-to-nearest quantization, group-wise along the input):
- AWQ: qweight int32 [in, out / 8], nibble i of int c = column 8c + [0,2,4,6,1,3,5,7][i];
  qzeros int32 [in / group, out / 8] the same; scales half [in / group, out].
- GPTQ: qweight int32 [in / 8, out], nibble i of row r = input 8r + i; qzeros int32
  [groups, out / 8], nibble i = column 8c + i, z - 1 in checkpoint_format "gptq" (v1), z in
  "gptq_v2"; scales half [groups, out]; g_idx int32 [in] = input // group.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.worker.tiny_dense import save_tiny

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_tiny_llama(path: Path, default_model_dir: Path) -> Path:
    """A tiny random float32 Llama whose linears have 128 or 256 inputs (groups of 32..128),
    with the default model's tokenizer (ids < 320 are real tokens)."""
    save_tiny("llama", path, hidden_size=128, intermediate_size=256)
    for file in TOKENIZER_FILES:
        shutil.copy(default_model_dir / file, path / file)
    return path


def rtn(w: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, ...]:
    """[out, in] -> q [out, in], z and s [out, groups]: 4-bit round to nearest per group."""
    g = w.reshape(w.shape[0], -1, group)  # [out, groups, group]
    if sym:  # GPTQ sym: zero 8, scale from the largest magnitude
        s = (g.abs().amax(2) * 2 / 15).clamp(min=1e-5).half()
        z = torch.full_like(s, 8, dtype=torch.int32)
    else:  # AWQ / GPTQ asym: min..max over 0..15
        lo, hi = g.amin(2), g.amax(2)
        s = ((hi - lo) / 15).clamp(min=1e-5).half()
        z = torch.round(-lo / s.float()).clamp(0, 15).to(torch.int32)
    q = torch.round(g / s.float()[..., None]) + z[..., None]
    return q.clamp(0, 15).to(torch.int32).reshape(w.shape), z, s


def pack_awq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM packing of q [out, in], z and s [out, groups]."""

    def pack(values: torch.Tensor) -> torch.Tensor:  # [rows, cols] -> [rows, cols / 8]
        packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
        for col in range(packed.shape[1]):
            for i, order in enumerate(AWQ_ORDER):
                packed[:, col] |= values[:, col * 8 + order] << (i * 4)
        return packed

    return {"qweight": pack(q.T.contiguous()), "qzeros": pack(z.T.contiguous()),
            "scales": s.T.contiguous()}  # fmt: skip


def pack_gptq(
    q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int, v1: bool
) -> dict[str, torch.Tensor]:
    """AutoGPTQ's packing (v1: zeros minus one) or GPTQModel's v2 of q [out, in], z, s."""
    weight = q.T.contiguous()  # [in, out]
    qweight = torch.zeros(weight.shape[0] // 8, weight.shape[1], dtype=torch.int32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= weight[row * 8 + j] << (j * 4)
    zeros = (z - 1 if v1 else z).T.contiguous()  # [groups, out]
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // 8, dtype=torch.int32)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= zeros[:, col * 8 + j] << (j * 4)
    g_idx = torch.arange(weight.shape[0], dtype=torch.int32) // group
    return {"qweight": qweight, "qzeros": qzeros, "scales": s.T.contiguous(), "g_idx": g_idx}


def dequantize_awq(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """The published AWQ dequantization -> [out, in] float32."""
    shifts = torch.arange(0, 32, 4)
    reverse = [AWQ_ORDER.index(j) for j in range(8)]

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        values = torch.bitwise_right_shift(packed[:, :, None], shifts[None, None, :]) & 15
        return values[:, :, reverse].reshape(packed.shape[0], -1)

    iweight, izeros = unpack(t["qweight"]), unpack(t["qzeros"])  # [in, out], [groups, out]
    rows = torch.arange(iweight.shape[0]) // group
    return ((iweight - izeros[rows]) * t["scales"].float()[rows]).T.contiguous()


def dequantize_gptq(t: dict[str, torch.Tensor], v1: bool) -> torch.Tensor:
    """The published GPTQ dequantization (AutoGPTQ's torch path) -> [out, in] float32."""
    wf = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(t["qzeros"][:, :, None], wf[None, None, :]) & 15
    zeros = zeros.reshape(zeros.shape[0], -1) + (1 if v1 else 0)  # [groups, out]
    weight = torch.bitwise_right_shift(t["qweight"][:, None, :], wf[None, :, None]) & 15
    weight = weight.reshape(-1, weight.shape[2])  # [in, out]
    g_idx = t["g_idx"].long()
    return (t["scales"].float()[g_idx] * (weight - zeros[g_idx])).T.contiguous()


def write_quantized(
    src: Path, dst: Path, method: str, group: int, *, sym: bool = False, v1: bool = True,
    config: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """`src`'s checkpoint as an AWQ / GPTQ one at `dst` (other tensors in float16); returns
    the float32 state dict the HF reference runs (each linear its dequantized weight)."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors, reference = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        stem, _, kind = name.rpartition(".")
        if kind != "weight" or stem.rpartition(".")[2] not in QUANTIZED:
            tensors[name] = w.half()
            reference[name] = w.half().float()
            continue
        q, z, s = rtn(w.float(), group, sym)
        if method == "awq":
            packed = pack_awq(q, z, s)
            reference[name] = dequantize_awq(packed, group)
        else:
            packed = pack_gptq(q, z, s, group, v1)
            reference[name] = dequantize_gptq(packed, v1)
        tensors |= {f"{stem}.{k}": v for k, v in packed.items()}
    save_file(tensors, dst / "model.safetensors")
    hf_config = json.loads((src / "config.json").read_text())
    quant = config if config is not None else _quant_config(method, group, sym, v1)
    hf_config |= {"torch_dtype": "float16", "quantization_config": quant}
    (dst / "config.json").write_text(json.dumps(hf_config))
    for file in (*TOKENIZER_FILES, "generation_config.json"):
        if (src / file).exists():
            shutil.copy(src / file, dst / file)
    return reference


def _quant_config(method: str, group: int, sym: bool, v1: bool) -> dict[str, Any]:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
            "desc_act": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"}  # fmt: skip


def hf_with_weights(src: Path, state: dict[str, torch.Tensor]) -> Any:
    """HF's model of `src`'s config in float32 running `state`'s weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    return model
