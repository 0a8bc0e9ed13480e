"""Build a model from an HF directory: config -> class -> weights loaded by name.

HF checkpoints store q/k/v and gate/up projections separately; the models fuse
them, so each checkpoint tensor is copied into a row range of a fused weight.
With tensor parallelism each rank reads only its share of each layer tensor
(safetensors slices): its rows of q/k/v and gate/up, its columns of o and down.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from services.gguf_model import LINK_NAME
from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelArchConfig, read_model_config
from worker_service.models.layers import deferred_weights
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.registry import check_features, model_class
from worker_service.parallel import LayerShard, TPGroup

log = logging.getLogger(__name__)

# HF projection name -> (fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    tp: TPGroup | None = None,
) -> LlamaForCausalLM:
    """Instantiate the registered class for `model_dir` and load its safetensors weights
    (this rank's share of them under tensor parallelism)."""
    from worker_service.prequantized import load_prequantized, read_prequant_config

    tp = tp or TPGroup()
    cfg = read_model_config(model_dir)
    cls = model_class(cfg.architecture)
    check_features(cls, cfg)
    gguf = (model_dir / LINK_NAME).exists()  # a GGUF file's directory (services.gguf_model)
    prequant = read_prequant_config(model_dir)  # AWQ / GPTQ (before any weight is read)
    if prequant is not None and tp.size > 1:
        raise ValueError(f"{prequant.source}: {prequant.method} with tensor parallelism: not yet")
    with torch.device(device), deferred_weights(gguf or prequant is not None):  # get blocks
        model = cls(cfg, backend, tp)
    _cast(model, dtype)
    if gguf:
        return _load_gguf(model, model_dir / LINK_NAME, dtype, tp)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    if prequant is not None:
        _check_complete(model, load_prequantized(model, files, prequant, dtype))
        _log_weight_bytes(model, tp)
        return model.eval()
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                # (vision towers, never split, only load with tp.size 1)
                tensor = _read_share(model, f, name) if tp.size > 1 else f.get_tensor(name)
                for part, piece in model.split_checkpoint(name, tensor):  # (Phi-3's fused)
                    loaded |= _load_tensor(model, model.config, part, piece, model.shard)
    _check_complete(model, loaded)
    _log_weight_bytes(model, tp)
    return model.eval()


def _load_gguf(
    model: LlamaForCausalLM, path: Path, dtype: torch.dtype, tp: TPGroup
) -> LlamaForCausalLM:
    """The weights from the GGUF file at `path`, block formats kept (worker_service.gguf)."""
    from worker_service.gguf import load_gguf_weights

    if tp.size > 1:
        raise ValueError(f"{path.name}: GGUF models with tensor parallelism are not supported yet")
    _check_complete(model, load_gguf_weights(model, path, dtype))
    _log_weight_bytes(model, tp)
    return model.eval()


def _read_share(model: LlamaForCausalLM, f: Any, name: str) -> torch.Tensor:
    """Checkpoint tensor `name`, or only this rank's slice of it (never the whole)."""
    custom = getattr(model, "read_checkpoint_share", None)  # MoE experts split their own way
    if custom is not None and (tensor := custom(f, name)) is not None:
        return tensor
    shard, head_dim = model.shard, model.config.head_dim
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 3 else ""
    q = (shard.q_start * head_dim, (shard.q_start + shard.num_heads) * head_dim)
    kv = (shard.kv_start * head_dim, shard.kv_end * head_dim)
    mlp = (shard.mlp_start, shard.mlp_end)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    if proj in rows:  # column-parallel: output rows (weight and bias)
        start, end = rows[proj]
        return f.get_slice(name)[start:end]
    columns = {"o_proj": q, "down_proj": mlp}
    if proj in columns and parts[-1] == "weight":  # row-parallel: input columns
        start, end = columns[proj]
        return f.get_slice(name)[:, start:end]
    return f.get_tensor(name)


def _log_weight_bytes(model: LlamaForCausalLM, tp: TPGroup) -> None:
    """Log what this rank holds: the decoder layers (split) and everything (incl. embedding)."""
    layers = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info(
        "rank %d holds %.1f MB of layer weights (%d bytes; %.1f MB with embedding and head)",
        tp.rank,
        layers / 1e6,
        layers,
        total / 1e6,
    )


def _cast(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Every weight in `dtype` (RMSNorm weights too, as HF keeps them)."""
    for p in model.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(dtype)


def _load_tensor(
    model: LlamaForCausalLM,
    cfg: ModelArchConfig,
    name: str,
    tensor: torch.Tensor,
    shard: LayerShard,
) -> set[str]:
    """Copy one checkpoint tensor into its parameter; returns the parameter names it filled."""
    rename = getattr(model, "checkpoint_name", None)  # VLMs map their HF layouts
    name = rename(name) if rename is not None else name.removeprefix("model.")
    if not name or "rotary_emb" in name:
        return set()
    if name.endswith("lm_head.weight") and cfg.tie_word_embeddings:
        return set()
    custom = getattr(model, "load_checkpoint_tensor", None)  # MoE: stacked expert weights
    if custom is not None and (filled := custom(name, tensor)) is not None:
        return set(filled)
    params = dict(model.named_parameters())
    parts = name.split(".")
    fused_target = _fused_target(parts)
    if fused_target is not None and fused_target[0] in params:  # (HF vision towers stay unfused)
        target, fused, part = fused_target
        rows = _fused_rows(cfg, fused, part, shard)
        params[target].data[rows[0] : rows[1]].copy_(tensor)
        return {f"{target}#{part}"}
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
    if params[name].shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint {tuple(tensor.shape)} != model {tuple(params[name].shape)}"
        )
    params[name].data.copy_(tensor)
    return {name}


def _fused_target(parts: list[str]) -> tuple[str, str, int] | None:
    """(fused parameter name, fused kind, part) for a q/k/v or gate/up checkpoint tensor."""
    if len(parts) < 3 or parts[-2] not in _FUSED:
        return None
    fused, part = _FUSED[parts[-2]]
    return ".".join([*parts[:-2], fused, parts[-1]]), fused, part


def _fused_rows(cfg: ModelArchConfig, fused: str, part: int, shard: LayerShard) -> tuple[int, int]:
    """Row range of part `part` (q/k/v or gate/up) inside this rank's fused weight."""
    if fused == "gate_up_proj":
        inter = shard.intermediate
        return part * inter, (part + 1) * inter
    q, kv = shard.num_heads * cfg.head_dim, shard.num_kv_heads * cfg.head_dim
    return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][part]


def _check_complete(model: LlamaForCausalLM, loaded: set[str]) -> None:
    """Every parameter (every shard of a fused one) must have come from the checkpoint."""
    missing = []
    custom = getattr(model, "checkpoint_parts", lambda name: None)  # MoE: per-expert parts
    for name, _ in model.named_parameters():
        if (parts := custom(name)) is not None:
            missing += [part for part in parts if part not in loaded]
        elif name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            missing += [f"{name}#{i}" for i in range(3) if f"{name}#{i}" not in loaded]
        elif name.endswith("gate_up_proj.weight"):
            missing += [f"{name}#{i}" for i in range(2) if f"{name}#{i}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(
            f"weights missing from the checkpoint: {missing[:5]} ({len(missing)} in all)"
        )
