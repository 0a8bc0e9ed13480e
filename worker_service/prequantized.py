"""AWQ and GPTQ checkpoints, read as they are: their 4-bit weights repacked at load into GGUF
Q4_1 (or Q4_0) blocks (models/quant_int4.py) that the C++ GEMM runs; no float copy is made.

config.json's `quantization_config` (or an older AutoGPTQ's quantize_config.json) says how:
- AWQ (AutoAWQ, `version` "gemm", `zero_point` true): per linear `qweight` int32
  [in, out / 8], each int32 eight output columns in the order [0, 2, 4, 6, 1, 3, 5, 7] at
  bits 0, 4, .., 28; `qzeros` int32 [in / group, out / 8] the same way; `scales` half
  [in / group, out]; w[out, in] = (q - z) * s.
- GPTQ (AutoGPTQ / GPTQModel, `desc_act` false or a g_idx that keeps 32-blocks whole):
  `qweight` int32 [in / 8, out] packed along the input, rows 8i..8i+7 at bits 0, 4, .., 28;
  `qzeros` int32 [groups, out / 8] along the output in order; `scales` half [groups, out];
  `g_idx` int32 [in] the group of each input; checkpoint_format "gptq" (v1) stores every zero
  minus one, "gptq_v2" as it is; w[out, in] = (q - z) * s.
A Q4 block is 32 consecutive inputs of a row with one scale d and offset m (w = d * q + m):
d = s, m = -z * s. A symmetric GPTQ checkpoint (every z = 8) is Q4_0, w = d * (q - 8),
exactly. Otherwise m rounded to half loses up to 0.48% of a quantization step (3e-5 on the
tiny test model), enough to change a greedy token of 8 x 32 against HF over the exact
weights, so that rounding is added back per call (quant_int4.ExactOffsetQ4_1): the weights
are exactly (q - z) * s. Other tensors (embedding, norms, an unquantized LM head) load as usual.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker_service.loader import _FUSED, _load_tensor
from worker_service.models import cpu_ops
from worker_service.models.layers import Linear
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.quant import BLOCK, BlockWeight
from worker_service.models.quant_int4 import ExactOffsetQ4_1, block_groups, pack_q4

METHODS = ("awq", "gptq")
_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized linear's tensors
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # the eight nibbles of an int32
_AWQ_UNDO = [0, 4, 1, 5, 2, 6, 3, 7]  # output column j of eight sits at nibble _AWQ_UNDO[j]


class QuantizedCheckpointError(ValueError):
    """An AWQ / GPTQ checkpoint Tessera cannot serve; names the file and what is wrong."""


@dataclass(frozen=True)
class PrequantConfig:
    """What a checkpoint's quantization_config says (the fields Tessera reads)."""

    method: str  # "awq" or "gptq"
    group_size: int  # inputs per scale; -1: one group per row
    symmetric: bool  # GPTQ `sym` (every zero 8); AWQ: false
    zeros_minus_one: bool  # GPTQ v1 checkpoint_format stores z - 1
    source: Path  # the file it came from, for errors


def read_prequant_config(model_dir: Path) -> PrequantConfig | None:
    """The AWQ / GPTQ config of `model_dir`; None for an unquantized checkpoint;
    QuantizedCheckpointError for a quantization Tessera does not serve."""
    source = model_dir / "config.json"
    raw = json.loads(source.read_text()).get("quantization_config") if source.exists() else None
    if raw is None and (model_dir / "quantize_config.json").exists():  # older AutoGPTQ
        source = model_dir / "quantize_config.json"
        raw = {"quant_method": "gptq", **json.loads(source.read_text())}
    return None if raw is None else _parse(raw, source)


def _parse(raw: dict[str, Any], source: Path) -> PrequantConfig:
    method = str(raw.get("quant_method", "")).lower()

    def fail(what: str) -> QuantizedCheckpointError:
        return QuantizedCheckpointError(f"{source}: {what}; Tessera serves 4-bit AWQ and GPTQ")

    if method not in METHODS:
        raise fail(f"quantization_config quant_method {method!r} is not supported")
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise fail(f"{method} with {bits} bits is not supported")
    group = int(raw.get("group_size", raw.get("q_group_size", -1)))
    if group != -1 and (group <= 0 or group % BLOCK):
        raise fail(f"group_size {group} is not -1 or a multiple of {BLOCK}")
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise fail(f"AWQ version {version!r} is not supported (only 'gemm')")
        if not raw.get("zero_point", True):
            raise fail("AWQ without zero points (zero_point false) is not supported")
        return PrequantConfig(method, group, False, False, source)
    fmt = str(raw.get("checkpoint_format", raw.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise fail(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return PrequantConfig(method, group, bool(raw.get("sym", True)), fmt == "gptq", source)


def check_quantization(model_dir: Path, quantization: str) -> None:
    """ValueError where `--quantization` contradicts the checkpoint's own (AWQ / GPTQ)."""
    config = read_prequant_config(model_dir)
    if config is None and quantization in METHODS:
        raise ValueError(f"--quantization {quantization}: {model_dir} has no quantization_config")
    if config is not None and quantization not in ("none", config.method):
        raise ValueError(
            f"{config.source}: a {config.method} checkpoint, already quantized: "
            f"drop --quantization {quantization}"
        )


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 8] int32 -> [rows, cols] nibbles, column 8c + i at bits 4i of int c."""
    nibbles = (packed[:, :, None] >> _SHIFTS) & 15  # [rows, cols / 8, 8]
    return nibbles.reshape(packed.shape[0], -1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 8] int32 in AutoAWQ's column order -> [rows, cols] nibbles."""
    nibbles = (packed[:, :, None] >> _SHIFTS) & 15  # [rows, cols / 8, 8]
    return nibbles[:, :, _AWQ_UNDO].reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[rows / 8, cols] int32 -> [rows, cols] nibbles, row 8r + i at bits 4i of row r."""
    nibbles = (packed[:, None, :] >> _SHIFTS[None, :, None]) & 15  # [rows / 8, 8, cols]
    return nibbles.reshape(-1, packed.shape[1])


def repack(tensors: dict[str, torch.Tensor], config: PrequantConfig, name: str) -> BlockWeight:
    """One linear's qweight / qzeros / scales (/ g_idx) -> its Q4 blocks [out, in / 32 * 20]."""
    missing = [p for p in _PARTS[:3] if p not in tensors]
    if missing:
        raise QuantizedCheckpointError(f"{config.source.parent}: {name} lacks {missing}")
    if config.method == "awq":
        q = unpack_awq(tensors["qweight"]).T  # [out, in]
        zeros = unpack_awq(tensors["qzeros"])  # [groups, out]
    else:
        q = unpack_rows(tensors["qweight"]).T
        zeros = unpack_columns(tensors["qzeros"]) + int(config.zeros_minus_one)
    scales = tensors["scales"].half()  # [groups, out]
    groups = _groups_of_blocks(tensors, config, q.shape[1], name)  # [in / 32]
    if scales.shape != zeros.shape or int(groups.max()) >= scales.shape[0]:
        raise QuantizedCheckpointError(
            f"{config.source.parent}: {name} scales {tuple(scales.shape)} / zeros "
            f"{tuple(zeros.shape)} do not fit {q.shape[1]} inputs in groups of {config.group_size}"
        )
    ops = cpu_ops.load()
    if config.symmetric and bool((zeros == 8).all()):
        return pack_q4(q, scales.T[:, groups], None, ops)  # exact: w = d * (q - 8)
    offset = (-zeros.float() * scales.float()).T  # [out, groups], exact in float32
    blocks = pack_q4(q, scales.T[:, groups], offset[:, groups], ops)
    residual = offset - offset.half().float()  # what the half offsets lose
    if not bool(residual.any()):
        return blocks
    return ExactOffsetQ4_1(
        blocks.blocks, blocks.ggml_type, blocks.in_features, ops, residual, groups
    )


def _groups_of_blocks(
    tensors: dict[str, torch.Tensor], config: PrequantConfig, in_features: int, name: str
) -> torch.Tensor:
    """[in / 32] the scale group of each 32-input block (g_idx where GPTQ gives one)."""
    where = f"{config.source.parent}: {name}"
    if in_features % BLOCK:
        raise QuantizedCheckpointError(f"{where}: {in_features} inputs are not whole 32-blocks")
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        return block_groups(in_features, config.group_size)
    blocks = g_idx.long().reshape(-1, BLOCK)  # [in / 32, 32]
    if not bool((blocks == blocks[:, :1]).all()):
        raise QuantizedCheckpointError(
            f"{where}.g_idx puts inputs of one 32-block in different groups (desc_act / "
            "act-order): not supported"
        )
    return blocks[:, 0]


def load_prequantized(
    model: LlamaForCausalLM, files: list[Path], config: PrequantConfig, dtype: torch.dtype
) -> set[str]:
    """Place every tensor of the safetensors `files` in `model` (built under
    layers.deferred_weights): the quantized linears as Q4 blocks, the rest as usual; the
    parameter names filled (as loader._check_complete counts them)."""
    from worker_service.gguf import _allocate

    loaded: set[str] = set()
    quantized: dict[str, dict[str, torch.Tensor]] = {}  # linear -> its packed tensors
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                stem, _, kind = name.removeprefix("model.").rpartition(".")
                if kind in _PARTS:
                    quantized.setdefault(stem, {})[kind] = f.get_tensor(name)
                    continue
                for piece_name, piece in model.split_checkpoint(name, f.get_tensor(name)):
                    _allocate(model, piece_name.removeprefix("model."), dtype)
                    loaded |= _load_tensor(model, model.config, piece_name, piece, model.shard)
    fused: dict[str, dict[int, BlockWeight]] = {}  # q/k/v, gate/up: stacked once all are read
    for stem, tensors in quantized.items():
        linear, target, part = _linear(model, stem, config)
        weight = repack(tensors, config, stem)
        if part is None:
            linear.set_blocks(weight)  # (a checkpoint's own fused qkv_proj: all its parts)
            count = {"qkv_proj": 3, "gate_up_proj": 2}.get(stem.rpartition(".")[2], 0)
            loaded |= {f"{stem}.weight#{i}" for i in range(count)} or {f"{stem}.weight"}
        else:
            fused.setdefault(target, {})[part] = weight
    for target, parts in fused.items():
        loaded |= _set_stacked(model, target, parts, config)
    if unplaced := [n for n, p in model.named_parameters() if p.is_meta]:
        raise QuantizedCheckpointError(
            f"{config.source.parent}: no tensor for {unplaced[:3]} ({len(unplaced)} in all)"
        )
    return loaded


def _linear(
    model: LlamaForCausalLM, stem: str, config: PrequantConfig
) -> tuple[Linear, str, int | None]:
    """The Linear the checkpoint's quantized `stem` goes to, its name, and its part index
    where it is fused (q/k/v, gate/up)."""
    parts = stem.split(".")
    part = None
    if parts[-1] in _FUSED:
        parts[-1], part = _FUSED[parts[-1]]
    target = ".".join(parts)
    try:
        module = model.get_submodule(target)
    except AttributeError:
        module = None
    if not isinstance(module, Linear):
        raise QuantizedCheckpointError(
            f"{config.source.parent}: quantized {stem!r} has no linear layer in "
            f"{type(model).__name__}"
        )
    return module, target, part


def _set_stacked(
    model: LlamaForCausalLM, target: str, parts: dict[int, BlockWeight], config: PrequantConfig
) -> set[str]:
    """Stack the parts' block rows (q/k/v or gate/up order) into the fused Linear `target`."""
    count = 3 if target.endswith("qkv_proj") else 2
    where = f"{config.source.parent}: {target}"
    if sorted(parts) != list(range(count)):
        names = [k for k, (t, _) in _FUSED.items() if t == target.rpartition(".")[2]]
        raise QuantizedCheckpointError(f"{where} needs all of {names} quantized")
    ordered = [parts[i] for i in range(count)]
    first = ordered[0]
    if len({p.ggml_type for p in ordered}) > 1:
        raise QuantizedCheckpointError(f"{where}: its parts are symmetric and asymmetric")
    blocks = torch.cat([p.blocks for p in ordered])
    exact = [p for p in ordered if isinstance(p, ExactOffsetQ4_1)]
    if not exact:
        weight = BlockWeight(blocks, first.ggml_type, first.in_features, first.ops)
    else:
        block_group = exact[0].block_group
        if not all(torch.equal(p.block_group, block_group) for p in exact):
            raise QuantizedCheckpointError(f"{where}: its parts group their inputs differently")
        groups = exact[0].residual.shape[1]
        residual = torch.cat([
            p.residual if isinstance(p, ExactOffsetQ4_1) else p.blocks.new_zeros(p.blocks.shape[0], groups, dtype=torch.float32)
            for p in ordered
        ])  # fmt: skip
        weight = ExactOffsetQ4_1(
            blocks, first.ggml_type, first.in_features, first.ops, residual, block_group
        )
    model.get_submodule(target).set_blocks(weight)  # type: ignore[operator]
    return {f"{target}.weight#{i}" for i in range(count)}
