"""Attention backends behind one interface (see base.py), and the selector."""

from __future__ import annotations

import importlib

import torch

from worker_service.attention.base import AttentionBackend, AttentionMetadata

# name -> (module, class); imported lazily so CPU machines never import Triton.
_BACKENDS = {
    "cpu": ("worker_service.attention.cpu", "CpuAttentionBackend"),
    "triton": ("worker_service.attention.triton_backend", "TritonAttentionBackend"),
    "reference": ("worker_service.attention.reference", "ReferenceAttentionBackend"),
}

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called `name` ("auto": triton on CUDA, cpu otherwise), constructed with no
    arguments. ValueError for an unknown name or triton on a non-CUDA device."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (choose from auto, {', '.join(_BACKENDS)})"
        )
    if name == "triton" and device.type != "cuda":
        raise ValueError("the triton attention backend needs a CUDA device")
    module, cls = _BACKENDS[name]
    backend: AttentionBackend = getattr(importlib.import_module(module), cls)()
    return backend
