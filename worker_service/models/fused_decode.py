"""A decode step through every decoder layer in one native call (`decode_layers.h`).

At a few rows a CPU decode step is bound by reading the weights, and the ~15 torch calls of
each layer (30 layers in the default model) cost about a third of the step in dispatch.
`FusedDecode` stands in for the model's forward: a step of decode tokens only (one per
request, no images, at most `max_rows` of them) runs the embedding and the rotary lookup in
torch, then every layer in one ctypes call of the fused CPU ops (the same RMSNorm, RoPE,
SiLU and GEMM kernels the layers call one by one, and the paged decode-attention kernel),
then the final norm; any other step runs the model as usual.

`build` takes a plain Llama-family model (Llama, Mistral, SmolLM2, Qwen2) whose layers
already run the fused CPU ops, with dense weights in the model dtype or GGUF blocks, KV
pools in the model dtype or quantized (int8 / fp8_e4m3: K and V quantized per slot and head
as kv_quant.write does, K and the queries Hadamard-rotated for int8 as kv_rotation does), no
tensor parallelism and no LoRA; anything else keeps the model.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from worker_service.attention import cpu_kernel, kv_quant, kv_rotation
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.cpu import CpuAttentionBackend
from worker_service.models import onednn_bridge
from worker_service.models.context import get_attention_metadata
from worker_service.models.cpu_ops import DTYPES, SMALL_GEMM_ROWS, CpuOps
from worker_service.models.layers import GatedMLP, Linear, RMSNorm, RowParallelLinear
from worker_service.models.llama import (
    DecoderLayer,
    LlamaForCausalLM,
    PagedAttention,
    Qwen2ForCausalLM,
)
from worker_service.models.onednn_bridge import OnednnGemm

log = logging.getLogger(__name__)

# Decode rows up to which one call beats the layers' torch path, by weight format (measured
# with benchmarks.decode_bench: the dense few-row GEMM loses to oneDNN's beyond a few rows;
# AMX tiles and GGUF blocks take the same GEMM on both paths, so only dispatch differs).
DENSE_ROWS = SMALL_GEMM_ROWS
ONEDNN_ROWS = 256  # dense weights with oneDNN's GEMM past SMALL_GEMM_ROWS (onednn_bridge)
AMX_ROWS = 64
BLOCK_ROWS = 64
MODELS = (LlamaForCausalLM, Qwen2ForCausalLM)  # exactly these: subclasses change the layers
DENSE = -1  # TesseraLinear.type of a dense weight


class _Linear(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int64),
        ("weight", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("K", ctypes.c_int64),
        ("N", ctypes.c_int64),
        ("amx", ctypes.c_void_p),
        ("gemm", ctypes.c_void_p),
        ("context", ctypes.c_void_p),
        ("gemm_rows", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _Linear) for name in ("qkv", "o", "gate_up", "down")),
        *((name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "k_cache", "v_cache")),
        ("window", ctypes.c_int64),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim")),
        ("inter", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("cache_dtype", ctypes.c_int64),
        ("rotate", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


_ARGTYPES: list[Any] = [
    ctypes.c_int,  # dtype
    ctypes.c_void_p,  # shape
    ctypes.c_void_p,  # layers
    ctypes.c_int64,  # num_layers
    ctypes.c_void_p,  # x
    ctypes.c_void_p,  # residual
    ctypes.c_int64,  # rows
    *[ctypes.c_void_p] * 4,  # cos, sin, slots, block_table
    ctypes.c_int64,  # table_stride
    *[ctypes.c_void_p] * 3,  # seq_lens, index, attend
    ctypes.c_int,  # num_threads
]


class Unfusable(ValueError):
    """Why a model keeps its layer-by-layer forward."""


class FusedDecode:
    """The model's forward, with steps of few decode tokens in one native call."""

    def __init__(self, model: LlamaForCausalLM, ops: CpuOps, max_rows: int) -> None:
        """Raises Unfusable where the model is not one `decode_layers.h` runs."""
        self.model = model
        self.dtype = model.embed_tokens.weight.dtype
        if self.dtype not in DTYPES:
            raise Unfusable(f"dtype {self.dtype}")
        layers = list(model.layers)
        self._keep: list[torch.Tensor] = []  # every tensor the layer table points into
        self._gemms: list[OnednnGemm] = []  # every callback context it points to
        self.bridge = onednn_bridge.load()
        self.layers = (_Layer * len(layers))(*(self._layer(layer) for layer in layers))
        self.shape = _shape(model, layers)
        self.max_rows = max_rows
        self.lib = ops.lib
        entry = self.lib.tessera_decode_layers
        entry.argtypes, entry.restype = _ARGTYPES, ctypes.c_int
        kernel = cpu_kernel.load()
        if kernel is None:
            raise Unfusable("no paged decode kernel")
        self.attend = ctypes.cast(kernel.tessera_paged_decode, ctypes.c_void_p).value
        self._index: dict[int, torch.Tensor] = {}

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's forward: final-normed hidden [num_tokens, hidden]."""
        meta = get_attention_metadata()
        if input_embeds is not None or not self.takes(meta, input_ids, positions):
            return self.model(input_ids, positions, input_embeds)
        cos, sin = self.model.rotary.lookup(positions, self.dtype)  # [n, 1, head_dim / 2]
        residual = self.model.embed_tokens(input_ids).contiguous()  # [n, hidden]
        x = torch.empty_like(residual)
        self._run(x, residual, cos.contiguous(), sin.contiguous(), meta)
        return self.model.norm(x, residual)[0]

    def takes(
        self, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> bool:
        """Whether this step is one decode token per request, few enough for one call."""
        rows = input_ids.shape[0]
        return (
            0 < rows <= self.max_rows
            and meta.max_query_len == 1
            and meta.num_reqs == rows
            and not meta.verify_reqs
            and positions.dim() == 1
        )

    def _run(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        rows = x.shape[0]
        index = self._index.get(rows)
        if index is None:
            index = self._index[rows] = torch.arange(rows, dtype=torch.int64)
        table, seq_lens, slots = meta.block_table, meta.seq_lens, meta.slot_mapping
        assert table.dtype == seq_lens.dtype == torch.int32 and slots.dtype == torch.int64
        assert table.is_contiguous() and seq_lens.is_contiguous() and slots.is_contiguous()
        status = self.lib.tessera_decode_layers(
            DTYPES[self.dtype], ctypes.addressof(self.shape), ctypes.addressof(self.layers),
            len(self.layers), x.data_ptr(), residual.data_ptr(), rows, cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), table.data_ptr(), table.shape[1],
            seq_lens.data_ptr(), index.data_ptr(), self.attend, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise ValueError(f"fused decode step rejected its arguments (status {status})")

    def _layer(self, layer: Any) -> _Layer:
        if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, GatedMLP):
            raise Unfusable(f"layer {type(layer).__name__}")
        attn = layer.self_attn
        _check_attention(attn, self.dtype)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        return _Layer(
            *(self._linear(linear) for linear in linears),
            *(self._ptr(norm_weight(norm, self.dtype)) for norm in norms),
            self._ptr(attn.k_cache),
            self._ptr(attn.v_cache),
            attn.sliding_window,
        )

    def _linear(self, linear: Any) -> _Linear:
        if type(linear) not in (Linear, RowParallelLinear):  # e.g. a LoRA wrapper
            raise Unfusable(f"a {type(linear).__name__} GEMM")
        if linear.tile_rows:  # its rows must not depend on the batch: the layers tile them
            raise Unfusable("batch-invariant GEMMs (--deterministic)")
        bias = None if linear.bias is None else self._ptr(_in(linear.bias.data, self.dtype))
        if linear.quant is not None:
            q = linear.quant
            if q.ops is None or q.blocks.device.type != "cpu":
                raise Unfusable(f"GGUF type {q.ggml_type} without the CPU GEMM")
            return _Linear(
                q.native_type, self._ptr(q.blocks), bias, q.in_features, q.blocks.shape[0]
            )
        weight = _in(linear.weight.data, self.dtype)
        amx = self._ptr(linear.amx) if linear.amx is not None else None
        dense = _Linear(DENSE, self._ptr(weight), bias, weight.shape[1], weight.shape[0], amx)
        if amx is None and linear.packed is not None and self.bridge is not None:  # as _gemm
            self._gemms.append(self.bridge.context(linear, self.dtype))
            dense.gemm, dense.context = self.bridge.gemm, self._gemms[-1].handle
            dense.gemm_rows = SMALL_GEMM_ROWS + 1 if linear.small_gemm is not None else 1
        return dense

    def _ptr(self, t: torch.Tensor) -> int:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise Unfusable("a non-contiguous or non-CPU tensor")
        self._keep.append(t)
        return t.data_ptr()


def build(model: Any, backend: Any, max_rows: int) -> FusedDecode | None:
    """`model`'s forward with fused decode steps of up to `max_rows` tokens (-1: by its weight
    format), or None where it cannot take them (logged) or `max_rows` is 0."""
    if max_rows == 0:
        return None
    try:
        if type(model) not in MODELS or model.tp.size > 1:
            raise Unfusable(f"model {type(model).__name__} (tp {model.tp.size})")
        if not isinstance(backend, CpuAttentionBackend) or not backend.decode_kernel:
            raise Unfusable("attention is not the CPU paged decode kernel")
        if not model.rotary.full:
            raise Unfusable("partial rotary embedding")
        ops = model.norm.ops
        if ops is None:
            raise Unfusable("the fused CPU ops are off")
        if max_rows < 0:
            max_rows = default_rows(model.layers[0].mlp.down_proj)
        return FusedDecode(model, ops, max_rows)
    except Unfusable as why:
        log.info("decode steps run layer by layer: %s", why)
        return None


def default_rows(linear: Linear) -> int:
    """--fused-decode-rows -1 for a model whose GEMMs are like `linear`'s."""
    if linear.quant is not None:
        return BLOCK_ROWS
    if linear.amx is not None:
        return AMX_ROWS
    return ONEDNN_ROWS if linear.packed is not None and onednn_bridge.load() else DENSE_ROWS


def _check_attention(attn: PagedAttention, dtype: torch.dtype) -> None:
    if attn.q_norm is not None or attn.softcap > 0 or attn.ops is None:
        raise Unfusable("q/k norm, soft-capping or torch RoPE")
    pool = attn.k_cache
    width = kv_quant.slot_width(attn.head_dim, pool.dtype)
    if pool.dtype not in (dtype, *kv_quant.QUANTIZED) or pool.dim() != 4 or pool.shape[3] != width:
        raise Unfusable(f"KV pool {pool.dtype} {tuple(pool.shape)}")
    if kv_rotation.applies(pool, attn.head_dim) and (kv_rotation.ROTATE_V or attn.head_dim > 1024):
        raise Unfusable("V rotated (kv_rotation.ROTATE_V) or a head over 1024")


def _cache_dtype(pool: torch.Tensor, dtype: torch.dtype) -> int:
    """TesseraDecodeShape.cache_dtype of a pool in a `dtype` model (the paged decode kernel's
    codes: 0 the model dtype, else cpu_kernel.CACHE_DTYPES)."""
    return 0 if pool.dtype == dtype else cpu_kernel.CACHE_DTYPES[pool.dtype]


def norm_weight(norm: RMSNorm, dtype: torch.dtype) -> torch.Tensor:
    """An RMSNorm's weight, checked to be what its fused op reads."""
    if norm.ops is None:
        raise Unfusable("an RMSNorm without the fused op")
    return _in(norm.weight.data, dtype)


def _in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype != dtype:
        raise Unfusable(f"a {t.dtype} tensor in a {dtype} model")
    return t


def _shape(model: LlamaForCausalLM, layers: list[Any]) -> _Shape:
    attn = layers[0].self_attn
    if any(layer.self_attn.scale != attn.scale for layer in layers):
        raise Unfusable("attention scales differ between layers")
    return _Shape(
        model.config.hidden_size,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        layers[0].mlp.intermediate,
        attn.k_cache.shape[1],
        _cache_dtype(attn.k_cache, model.embed_tokens.weight.dtype),
        int(kv_rotation.applies(attn.k_cache, attn.head_dim)),
        layers[0].input_layernorm.eps,
        attn.scale,
    )
