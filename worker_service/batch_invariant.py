"""Batch-invariant mode (--deterministic, vLLM's VLLM_BATCH_INVARIANT).

A request's logits must not depend on which other requests share its step, on how its
prompt is cut into chunks, or on whether its prefix came from the prefix cache. Three kinds
of computation decide a token's bits:
- GEMMs (every layers.Linear, LM head included): oneDNN's float32 and MKL's kernels change
  their reduction with the number of rows, so each runs as fixed-shape tiles of TILE_ROWS
  rows (layers.in_row_tiles);
- attention: the backend's batch-invariant mode (CPU: every token a row of the C++ kernel
  with its own causal length, KV split at fixed token counts);
- the rest (RMSNorm, RoPE, SiLU * up, residual adds, log-softmax and argmax in the sampler)
  is row-wise already: each row is reduced alone, in an order fixed by its width
  (tests/worker/test_batch_invariant.py checks it bit for bit).
What has no batch-invariant form yet is refused at start, not run silently: mixture-of-experts
layers (tokens grouped by expert), GEMMs outside layers.Linear (vision encoders), attention
score soft-capping (Gemma 2), and non-CPU devices (the Triton kernels).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend
from worker_service.models.layers import Linear
from worker_service.models.moe import FusedMoE

log = logging.getLogger(__name__)

# Rows per GEMM call: every GEMM runs on exactly this many rows. Larger tiles run prefill
# GEMMs faster, smaller ones waste less on padding at small decode batches (16 > the few-row
# GEMM's 8 rows, so every tile takes the same oneDNN path).
TILE_ROWS = 16


def make_batch_invariant(model: nn.Module, backend: AttentionBackend, device: torch.device) -> None:
    """Switch `model` and `backend` to batch-invariant kernels, or raise ValueError naming
    the part that has none."""
    if device.type != "cpu":
        raise ValueError("--deterministic runs on CPU only (the Triton kernels have no such mode)")
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            raise ValueError(f"--deterministic does not support mixture-of-experts ({name})")
        if isinstance(module, nn.Linear) and not isinstance(module, Linear):
            raise ValueError(f"--deterministic: {name} is a GEMM it cannot tile (vision encoder?)")
        if getattr(module, "softcap", 0.0) and hasattr(module, "backend"):
            raise ValueError(f"--deterministic does not support attention soft-capping ({name})")
    backend.make_batch_invariant()
    for module in model.modules():
        if isinstance(module, Linear):
            module.tile_rows = TILE_ROWS
    log.info("deterministic: GEMMs in %d-row tiles, batch-invariant %s attention", TILE_ROWS,
             backend.name)  # fmt: skip
