"""Reading a PEFT LoRA adapter directory's config (no torch): what the gateway checks before
it serves an adapter, and the worker before it loads the weights.

A directory holds adapter_config.json + adapter_model.safetensors. Supported: plain LoRA on
the decoder's q/k/v/o/gate/up/down projections, any rank up to max_lora_rank, lora_alpha,
rsLoRA scaling. Refused with a clear error: DoRA, bias training, modules_to_save,
fan_in_fan_out, per-module rank/alpha patterns, other targets (embeddings, lm_head).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdapterConfig:
    """What Tessera uses of a PEFT adapter_config.json."""

    rank: int
    scaling: float  # lora_alpha / r (rsLoRA: lora_alpha / sqrt(r))
    target_modules: tuple[str, ...]
    weights_path: Path


def read_adapter_config(path: str | Path, max_lora_rank: int) -> AdapterConfig:
    """The adapter at `path`, checked; ValueError naming the problem otherwise."""
    if not str(path):
        raise ValueError("a LoRA adapter needs a lora_path (its PEFT directory)")
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter path {str(path)!r} is not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise ValueError(f"LoRA adapter {str(path)!r} has no {name}")
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: unreadable {CONFIG_FILE}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    _refuse_unsupported(raw, str(path))
    rank = raw.get("r")
    if type(rank) is not int or rank < 1:
        raise ValueError(f"LoRA adapter {str(path)!r}: r must be a positive integer, not {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter {str(path)!r} has rank {rank} > max_lora_rank {max_lora_rank}"
        )
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {str(path)!r}: lora_alpha must be a number")
    scaling = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    targets = _targets(raw.get("target_modules"), str(path))
    return AdapterConfig(rank, float(scaling), targets, directory / WEIGHTS_FILE)


def _refuse_unsupported(raw: dict[str, Any], path: str) -> None:
    peft_type = raw.get("peft_type", "LORA")
    checks = [
        (peft_type == "LORA", f"peft_type {peft_type!r} (only LORA)"),
        (not raw.get("use_dora"), "DoRA (use_dora)"),
        (raw.get("bias", "none") == "none" and not raw.get("lora_bias"), "trained biases"),
        (not raw.get("modules_to_save"), "modules_to_save"),
        (not raw.get("fan_in_fan_out"), "fan_in_fan_out"),
        (not raw.get("rank_pattern") and not raw.get("alpha_pattern"), "rank/alpha patterns"),
        (not raw.get("layer_replication"), "layer_replication"),
        (not raw.get("trainable_token_indices"), "trainable_token_indices"),
    ]
    for ok, what in checks:
        if not ok:
            raise ValueError(f"LoRA adapter {path!r} uses {what}, which is not supported")


def _targets(value: Any, path: str) -> tuple[str, ...]:
    """target_modules as a tuple of supported projection names."""
    if value == _ALL_LINEAR:
        return TARGETS
    if isinstance(value, str):  # a regex over module names: the weights decide
        found = tuple(t for t in TARGETS if re.search(value, f"model.layers.0.x.{t}"))
        return found or TARGETS
    if not isinstance(value, list) or not value:
        raise ValueError(f"LoRA adapter {path!r}: target_modules must be a non-empty list")
    names = tuple(str(v).rsplit(".", 1)[-1] for v in value)
    bad = [n for n in names if n not in TARGETS]
    if bad:
        raise ValueError(
            f"LoRA adapter {path!r} targets {bad}; supported targets are {list(TARGETS)}"
        )
    return names
