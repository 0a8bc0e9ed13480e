"""A PEFT adapter's tensors, read into per-layer (A, B) pairs with the scaling folded into B."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.lora_adapter import read_adapter_config

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight -> (3, "q_proj", "A")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


@dataclass
class LoRAWeights:
    """One adapter in host memory: (layer, projection) -> A [r, in], B [out, r] (scaled)."""

    rank: int
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def load_lora_weights(path: str | Path, max_lora_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """Read and check the adapter at `path`; ValueError naming what is wrong."""
    from safetensors import safe_open

    config = read_adapter_config(path, max_lora_rank)
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(str(config.weights_path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            match = _KEY.search(key)
            if match is None or match.group(2) not in config.target_modules:
                raise ValueError(f"LoRA adapter {str(path)!r}: unsupported tensor {key!r}")
            layer, proj, half = int(match.group(1)), match.group(2), match.group(3)
            halves[(layer, proj, half)] = f.get_tensor(key).to(torch.float32)
    weights = LoRAWeights(config.rank)
    for (layer, proj, half), tensor in halves.items():
        if half != "A":
            continue
        b = halves.get((layer, proj, "B"))
        if b is None or tensor.shape[0] != config.rank or b.shape[1] != config.rank:
            raise ValueError(f"LoRA adapter {str(path)!r}: layer {layer} {proj} A/B mismatch")
        weights.pairs[(layer, proj)] = (tensor.to(dtype), (b * config.scaling).to(dtype))
    if not weights.pairs:
        raise ValueError(f"LoRA adapter {str(path)!r} holds no LoRA weights")
    return weights
