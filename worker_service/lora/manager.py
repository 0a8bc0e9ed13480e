"""The worker's adapters: a host-memory LRU of loaded PEFT adapters and `max_loras` device
slots (LRU too), wired into the model's projections as LoRALinear layers.

Per step the runner calls `set_step(states, counts)`: each adapter the step uses gets a
slot (loading it from host memory, evicting the least recently used slot the step does
not need), and the step's token segments are published to every LoRALinear. The
scheduler admits at most max_loras distinct adapters into the running batch, so a step
never needs more slots than there are.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from services.lora_config import LoRAConfig
from services.types import LoRARequest
from worker_service.lora.layers import LoRABatch, LoRALinear, LoRAPart
from worker_service.lora.weights import LoRAWeights, load_lora_weights

log = logging.getLogger(__name__)


class _HasLoRA(Protocol):
    lora: LoRARequest | None


class LoRAManager:
    """Adapter weights (host LRU), device slots (LRU) and the step's segments."""

    def __init__(
        self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config, self.device = config, device
        # Float32 on CPU, as PEFT computes (its adapter weights are upcast), and where bf16
        # GEMMs may be emulated; the model dtype on GPU.
        self.dtype = torch.float32 if device.type == "cpu" else dtype
        self.batch = LoRABatch()
        self.layers = wrap_model(model, config, self.batch, self.dtype, device)
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()  # lora_int_id -> weights
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.free_slots = list(range(config.max_loras - 1, -1, -1))

    # ---- adapters --------------------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> LoRAWeights:
        """The adapter's weights, loaded (and checked against the model) if not cached."""
        weights = self.loaded.get(request.lora_int_id)
        if weights is not None:
            self.loaded.move_to_end(request.lora_int_id)
            return weights
        weights = load_lora_weights(request.lora_path, self.config.max_lora_rank, self.dtype)
        self._check_shapes(weights, request)
        while len(self.loaded) >= self.config.cpu_loras:
            evicted, _ = self.loaded.popitem(last=False)
            log.info("LoRA: dropped adapter %d from host memory (LRU)", evicted)
        self.loaded[request.lora_int_id] = weights
        log.info(
            "LoRA: loaded %r (id %d, rank %d)", request.lora_name, request.lora_int_id, weights.rank
        )
        return weights

    def _check_shapes(self, weights: LoRAWeights, request: LoRARequest) -> None:
        for (layer, proj), (a, b) in weights.pairs.items():
            if layer >= len(self.layers):
                raise ValueError(f"LoRA {request.lora_name!r}: layer {layer} is not in the model")
            module, p = self.layers[layer][proj]
            part = module.parts[p]
            if a.shape[1] != module.lora_a.shape[2] or b.shape[0] != part.out_end - part.out_start:
                raise ValueError(
                    f"LoRA {request.lora_name!r}: layer {layer} {proj} shapes "
                    f"{tuple(a.shape)}/{tuple(b.shape)} do not fit the model"
                )

    # ---- slots -----------------------------------------------------------------------

    def set_step(self, states: Sequence[_HasLoRA], counts: Sequence[int]) -> None:
        """Give the step's adapters slots and publish its token segments (see module doc)."""
        segments: list[tuple[int, int, int]] = []
        needed = {s.lora.lora_int_id for s in states if s.lora is not None}
        start = 0
        for state, n in zip(states, counts, strict=True):
            if state.lora is not None:
                slot = self._slot(state.lora, needed)
                if segments and segments[-1][0] == slot and segments[-1][2] == start:
                    segments[-1] = (slot, segments[-1][1], start + n)
                else:
                    segments.append((slot, start, start + n))
            start += n
        self.batch.segments = segments

    def _slot(self, request: LoRARequest, needed: set[int]) -> int:
        slot = self.slot_of.get(request.lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(request.lora_int_id)
            return slot
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((i for i in self.slot_of if i not in needed), None)
            if victim is None:
                raise RuntimeError(
                    f"a step uses more than max_loras={self.config.max_loras} adapters"
                )
            slot = self.slot_of.pop(victim)
        self._fill(slot, self.add_adapter(request))
        self.slot_of[request.lora_int_id] = slot
        return slot

    def _fill(self, slot: int, weights: LoRAWeights) -> None:
        for layer, modules in enumerate(self.layers):
            for module in {id(m): m for m, _ in modules.values()}.values():
                module.set_slot(slot, [weights.pairs.get((layer, p.name)) for p in module.parts])


def wrap_model(
    model: nn.Module, config: LoRAConfig, batch: LoRABatch, dtype: torch.dtype, device: torch.device
) -> list[dict[str, tuple[LoRALinear, int]]]:
    """Replace each decoder layer's projections with LoRALinear; returns, per layer, the
    PEFT projection name -> (its LoRALinear, its part index)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("LoRA supports Llama-family decoder models only")
    tables = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        inter = mlp.intermediate

        def wrap(owner: nn.Module, name: str, parts: list[LoRAPart]) -> LoRALinear:
            base = getattr(owner, name)
            module = LoRALinear(
                base,
                parts,
                base.in_features,
                config.max_loras,
                config.max_lora_rank,
                batch,
                dtype,
                device,
            )
            setattr(owner, name, module)
            return module

        qkv = wrap(
            attn,
            "qkv_proj",
            [
                LoRAPart("q_proj", 0, q),
                LoRAPart("k_proj", q, q + kv),
                LoRAPart("v_proj", q + kv, q + 2 * kv),
            ],
        )
        o = wrap(attn, "o_proj", [LoRAPart("o_proj", 0, attn.o_proj.out_features)])
        gate_up = wrap(
            mlp,
            "gate_up_proj",
            [LoRAPart("gate_proj", 0, inter), LoRAPart("up_proj", inter, 2 * inter)],
        )
        down = wrap(mlp, "down_proj", [LoRAPart("down_proj", 0, mlp.down_proj.out_features)])
        tables.append(
            {
                "q_proj": (qkv, 0),
                "k_proj": (qkv, 1),
                "v_proj": (qkv, 2),
                "o_proj": (o, 0),
                "gate_proj": (gate_up, 0),
                "up_proj": (gate_up, 1),
                "down_proj": (down, 0),
            }
        )
    return tables
