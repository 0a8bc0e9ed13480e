"""The paged KV pool: its spec, how much memory it may take, and its allocation.

Per layer, K and V are each `[num_blocks, block_size, num_kv_heads, head_dim]`
in the model dtype; each attention layer is bound to its own pair. With a quantized
--kv-cache-dtype each slot's head row is `head_dim + 2` 1-byte elements: the values and
their float16 scale (attention.kv_quant).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from services.step_types import KVCacheSpec
from worker_service.attention import kv_quant
from worker_service.models.config import ModelArchConfig
from worker_service.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# Share of free RAM the CPU pool may take at most (the rest is for activations and the OS).
CPU_RAM_FRACTION = 0.9


def make_spec(
    cfg: ModelArchConfig,
    block_size: int,
    dtype: torch.dtype,
    num_kv_heads: int = 0,
    cache_dtype: str = "auto",
) -> KVCacheSpec:
    """Layout and byte size of one block across all layers (K and V), on one rank: with
    tensor parallelism each rank holds its `num_kv_heads` of every block (0: all).
    `cache_dtype` (--kv-cache-dtype) other than auto: 8-bit K/V plus their scales."""
    pool = kv_quant.pool_dtype(cache_dtype, dtype)
    elem = torch.empty(0, dtype=pool).element_size()
    num_kv_heads = num_kv_heads or cfg.num_kv_heads
    width = kv_quant.slot_width(cfg.head_dim, pool)
    per_layer = 2 * block_size * num_kv_heads * width * elem
    windows = cfg.sliding_windows
    return KVCacheSpec(
        num_layers=cfg.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=str(pool).removeprefix("torch."),
        block_size=block_size,
        bytes_per_block=per_layer * cfg.num_layers,
        sliding_window=max(windows) if windows and min(windows) > 0 else 0,
        length_dependent_rope=cfg.rope.length_dependent,
        rope_recompute_length=cfg.rope_recompute_length,
    )


def free_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (psutil elsewhere)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import psutil

    return int(psutil.virtual_memory().available)


def cpu_kv_budget(configured: int) -> int:
    """The configured `--kv-cache-memory`, capped to what free RAM allows (with a warning)."""
    limit = int(free_ram_bytes() * CPU_RAM_FRACTION)
    if configured > limit:
        log.warning(
            "kv cache memory %.2f GiB exceeds %.0f%% of free RAM; using %.2f GiB",
            configured / 2**30,
            CPU_RAM_FRACTION * 100,
            limit / 2**30,
        )
        return limit
    return configured


def allocate(
    model: LlamaForCausalLM,
    spec: KVCacheSpec,
    num_blocks: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Allocate zeroed pools of `num_blocks` blocks, bind them to the layers; returns bytes.
    The pools are `spec.dtype` (a quantized one, or `dtype`, the model's)."""
    if num_blocks < 1:
        raise ValueError("num_blocks must be >= 1")
    dtype = getattr(torch, spec.dtype) if spec.dtype else dtype
    width = kv_quant.slot_width(spec.head_dim, dtype)
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, width)
    for layer in model.attention_layers():
        layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
    return num_blocks * spec.bytes_per_block


def release(model: LlamaForCausalLM) -> None:
    """Drop the pools (the layers keep empty placeholders)."""
    for layer in model.attention_layers():
        layer.k_cache = layer.v_cache = torch.empty(0)
