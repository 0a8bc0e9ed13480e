"""A model's weights from its GGUF file (services/gguf_model.py made the directory), the
quantized ones kept in their blocks.

GGUF names its tensors the llama.cpp way (`blk.3.attn_q.weight`); each maps to the HF name
the loader places. Block tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K,
Q6_K: quant.TYPE_NAMES) become the Linear's `BlockWeight`: q/k/v and gate/up are fused by
stacking their block rows (rows are independent), or, where the parts are in different
formats, by putting their outputs side by side (`StackedBlocks`). llama.cpp's converter
permutes the rows of Llama's q and k projections (its RoPE pairs dims 2i, 2i + 1,
HF's i, i + d/2); the rows are put back in HF's order, blocks and all. The token embedding
keeps its blocks too (layers.Embedding dequantizes the rows a step looks up), and a tied LM
head multiplies by them. Float tensors (norms; F16/BF16 weights) load as a safetensors one
would.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from services.gguf_model import GGUFError, open_reader
from worker_service.loader import _FUSED, _fused_target, _load_tensor
from worker_service.models import cpu_ops
from worker_service.models.layers import Linear
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.quant import BlockWeight

# GGUF tensor name (after `blk.N.`) -> HF name (after `layers.N.`)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight` (model-relative)."""
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    raise GGUFError(f"GGUF tensor {name!r} has no place in a Llama-family model")


def load_gguf_weights(model: LlamaForCausalLM, path: Path, dtype: torch.dtype) -> set[str]:
    """Place every tensor of the GGUF file at `path` in `model` (built under
    layers.deferred_weights); the parameter names filled (as loader._check_complete counts
    them). A Linear given a float tensor gets its `dtype` weight then."""
    reader = open_reader(path)
    ops = cpu_ops.load()
    device = model.embed_tokens.weight.device  # blocks live there (CUDA: the Triton GEMM)
    permute = model.config.architecture == "LlamaForCausalLM"
    loaded: set[str] = set()
    fused: dict[str, dict[int, BlockWeight]] = {}  # fused Linear -> its parts' blocks
    names = {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        data = _tensor(tensor.data)
        kind = tensor.tensor_type.name
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _unpermute(data, model, name)
        if kind in _FLOAT_TYPES:
            dense = data.view(_FLOAT_TYPES[kind]).reshape(_shape(tensor))
            _allocate(model, name, dtype)
            loaded |= _load_tensor(model, model.config, name, dense.float(), model.shard)
            continue
        blocks = BlockWeight(data.to(device), int(tensor.tensor_type), int(tensor.shape[0]), ops)
        if name == "embed_tokens.weight":
            model.embed_tokens.set_blocks(blocks)
            loaded.add(name)
            if model.config.tie_word_embeddings and "output.weight" not in names:
                model.lm_head.set_blocks(blocks)
                loaded.add("lm_head.weight")
            continue
        loaded |= _place_blocks(model, name, blocks, fused)
    for target, parts in fused.items():
        loaded |= _set_fused(model, target, parts)
    if unplaced := [n for n, p in model.named_parameters() if p.is_meta]:
        raise GGUFError(f"{path}: no tensor for {unplaced[:3]} ({len(unplaced)} in all)")
    return loaded


def _allocate(model: LlamaForCausalLM, name: str, dtype: torch.dtype) -> None:
    """Give the (meta) parameter a float checkpoint tensor `name` fills a real tensor."""
    fused = _fused_target(name.split("."))
    target = fused[0] if fused is not None else name
    module_name, _, attr = target.rpartition(".")
    module = model.get_submodule(module_name)
    param = getattr(module, attr, None)
    if isinstance(param, torch.nn.Parameter) and param.is_meta:
        real = torch.empty(param.shape, dtype=dtype, device=model.embed_tokens.weight.device)
        setattr(module, attr, torch.nn.Parameter(real, requires_grad=False))


def _tensor(data: np.ndarray) -> torch.Tensor:
    """The file's bytes as a tensor, not copied: torch warns that the mapping is read-only,
    and nothing writes to it (blocks are read; float tensors are copied into parameters)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


def _shape(tensor: object) -> tuple[int, ...]:
    """GGUF lists dims innermost first; torch outermost first."""
    return tuple(int(d) for d in reversed(tensor.shape))  # type: ignore[attr-defined]


def _unpermute(rows: torch.Tensor, model: LlamaForCausalLM, name: str) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (i, half) -> (half, i)."""
    cfg = model.config
    heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1).contiguous()


def _place_blocks(
    model: LlamaForCausalLM,
    name: str,
    blocks: BlockWeight,
    fused: dict[str, dict[int, BlockWeight]],
) -> set[str]:
    """A block tensor into its Linear now, or kept for its fused Linear (q/k/v, gate/up)."""
    parts = name.split(".")
    if parts[-1] != "weight":
        raise GGUFError(f"{name}: a block-quantized {parts[-1]} is not supported")
    if parts[-2] in _FUSED:
        target, index = _FUSED[parts[-2]]
        fused.setdefault(".".join([*parts[:-2], target]), {})[index] = blocks
        return set()
    _linear(model, ".".join(parts[:-1])).set_blocks(blocks)
    return {name}


def _set_fused(model: LlamaForCausalLM, target: str, parts: dict[int, BlockWeight]) -> set[str]:
    """Stack the parts' block rows (in q/k/v or gate/up order) into the fused Linear."""
    count = 3 if target.endswith("qkv_proj") else 2
    if sorted(parts) != list(range(count)):
        raise GGUFError(f"{target}: the GGUF file lacks some of its parts")
    ordered = [parts[i] for i in range(count)]
    first = ordered[0]
    if len({p.ggml_type for p in ordered}) > 1:
        _linear(model, target).set_blocks(StackedBlocks.of(ordered))
    else:
        stacked = torch.cat([p.blocks for p in ordered])
        _linear(model, target).set_blocks(
            BlockWeight(stacked, first.ggml_type, first.in_features, first.ops)
        )
    return {f"{target}.weight#{i}" for i in range(count)}


@dataclass
class StackedBlocks(BlockWeight):
    """A fused Linear whose parts the file stores in different block formats (llama.cpp's
    Q4_K_M keeps some layers' v in Q6_K, q and k in Q4_K): each part multiplies by its own
    blocks and the outputs are put side by side. The inherited fields are the first part's."""

    parts: list[BlockWeight] = field(default_factory=list)

    @classmethod
    def of(cls, parts: list[BlockWeight]) -> StackedBlocks:
        first = parts[0]
        return cls(first.blocks, first.ggml_type, first.in_features, first.ops, parts)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[n, in] -> [n, out]: each part's rows (and its slice of the bias) in turn."""
        sizes = [p.blocks.shape[0] for p in self.parts]
        biases = [None] * len(sizes) if bias is None else list(bias.split(sizes))
        return torch.cat([p.linear(x, b) for p, b in zip(self.parts, biases, strict=True)], -1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def _linear(model: LlamaForCausalLM, name: str) -> Linear:
    module = model.get_submodule(name)
    if not isinstance(module, Linear):
        raise GGUFError(f"{name} is not a linear layer; its GGUF tensor cannot be placed")
    return module
