"""Build a model from an HF directory: config -> class -> weights loaded by name.

HF checkpoints store q/k/v and gate/up projections separately; the models fuse
them, so each checkpoint tensor is copied into a row range of a fused weight.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelArchConfig, read_model_config
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.registry import model_class

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
    model_dir: Path, dtype: torch.dtype, device: torch.device, backend: AttentionBackend
) -> LlamaForCausalLM:
    """Instantiate the registered class for `model_dir` and load its safetensors weights."""
    cfg = read_model_config(model_dir)
    cls = model_class(cfg.architecture)
    with torch.device(device):
        model = cls(cfg, backend)
    _cast(model, dtype)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                loaded |= _load_tensor(model, model.config, name, f.get_tensor(name))
    _check_complete(model, loaded)
    return model.eval()


def _cast(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Every weight in `dtype` (RMSNorm weights too, as HF keeps them)."""
    for p in model.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(dtype)


def _load_tensor(
    model: LlamaForCausalLM, cfg: ModelArchConfig, name: str, tensor: torch.Tensor
) -> set[str]:
    """Copy one checkpoint tensor into its parameter; returns the parameter names it filled."""
    rename = getattr(model, "checkpoint_name", None)  # VLMs map their HF layouts
    name = rename(name) if rename is not None else name.removeprefix("model.")
    if not name or "rotary_emb" in name:
        return set()
    if name.endswith("lm_head.weight") and cfg.tie_word_embeddings:
        return set()
    params = dict(model.named_parameters())
    parts = name.split(".")
    fused_target = _fused_target(parts)
    if fused_target is not None and fused_target[0] in params:  # (HF vision towers stay unfused)
        target, fused, shard = fused_target
        rows = _shard_rows(cfg, fused, shard)
        params[target].data[rows[0] : rows[1]].copy_(tensor)
        return {f"{target}#{shard}"}
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
    if params[name].shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint {tuple(tensor.shape)} != model {tuple(params[name].shape)}"
        )
    params[name].data.copy_(tensor)
    return {name}


def _fused_target(parts: list[str]) -> tuple[str, str, int] | None:
    """(fused parameter name, fused kind, shard) for a q/k/v or gate/up checkpoint tensor."""
    if len(parts) < 3 or parts[-2] not in _FUSED:
        return None
    fused, shard = _FUSED[parts[-2]]
    return ".".join([*parts[:-2], fused, parts[-1]]), fused, shard


def _shard_rows(cfg: ModelArchConfig, fused: str, shard: int) -> tuple[int, int]:
    """Row range of shard `shard` inside a fused weight."""
    if fused == "gate_up_proj":
        return shard * cfg.intermediate_size, (shard + 1) * cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]


def _check_complete(model: LlamaForCausalLM, loaded: set[str]) -> None:
    """Every parameter (every shard of a fused one) must have come from the checkpoint."""
    missing = []
    for name, _ in model.named_parameters():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            missing += [f"{name}#{i}" for i in range(3) if f"{name}#{i}" not in loaded]
        elif name.endswith("gate_up_proj.weight"):
            missing += [f"{name}#{i}" for i in range(2) if f"{name}#{i}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(
            f"weights missing from the checkpoint: {missing[:5]} ({len(missing)} in all)"
        )
