"""Triton attention backend: the CUDA path (see triton_kernels.py for the kernels)."""

from __future__ import annotations

import torch

from worker_service.attention import kv_quant, triton_kernels
from worker_service.attention.base import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Paged KV writes and varlen paged attention with Triton kernels.

    Expects CUDA tensors (or CPU tensors when the kernels were built under
    TRITON_INTERPRET=1). Query, K/V and the pools share one dtype (float32, float16 or
    bfloat16), or the pools are quantized (int8 / float8_e4m3fn with scales, kv_quant);
    every tensor's last dimension must be contiguous; num_heads must be a multiple of
    num_kv_heads. Metadata used: query_start_loc, seq_lens, block_table,
    slot_mapping (write_kv) and max_query_len; nothing is read back to the host.
    """

    name = "triton"
    batch_invariant = False  # set by make_batch_invariant (--deterministic)

    def make_batch_invariant(self) -> None:
        """One token per attention program, in fixed rows (triton_kernels doc)."""
        self.batch_invariant = True

    def _write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Store each token's K/V at its slot; tokens with a negative slot (padding) are skipped."""
        _check_device(key, k_cache, v_cache)
        _check_inner_contiguous(key=key, value=value, k_cache=k_cache, v_cache=v_cache)
        if kv_quant.is_quantized(k_cache):
            _check_same_dtype(key=key, value=value)
            _check_same_dtype(k_cache=k_cache, v_cache=v_cache)
        else:
            _check_same_dtype(key=key, value=value, k_cache=k_cache, v_cache=v_cache)
        triton_kernels.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def _forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        _check_device(query, k_cache, v_cache)
        _check_inner_contiguous(query=query, k_cache=k_cache, v_cache=v_cache)
        if kv_quant.is_quantized(k_cache):  # 8-bit pools with scales (kv_quant)
            _check_same_dtype(k_cache=k_cache, v_cache=v_cache)
            if not k_cache.is_contiguous() or not v_cache.is_contiguous():
                raise ValueError("a quantized KV pool must be contiguous")
        else:
            _check_same_dtype(query=query, k_cache=k_cache, v_cache=v_cache)
        if query.shape[1] % k_cache.shape[2] != 0:
            raise ValueError(
                f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}"
            )
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        if query.shape[0] == 0:
            return out
        triton_kernels.paged_attention(
            out,
            query,
            k_cache,
            v_cache,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            window=window,
            softcap=softcap,
            batch_invariant=self.batch_invariant,
        )
        return out


def _check_device(*tensors: torch.Tensor) -> None:
    if triton_kernels.interpreted():
        return
    if not all(t.is_cuda for t in tensors):
        raise RuntimeError(
            "TritonAttentionBackend needs CUDA tensors (or TRITON_INTERPRET=1 set before "
            "worker_service.attention.triton_kernels is imported, to run on CPU)"
        )


def _check_inner_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def _check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"attention tensors must share one dtype, got {dtypes}")
