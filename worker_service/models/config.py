"""The subset of an HF config.json the models need, read without transformers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Keys of an HF rope dict that some rope type reads; any other key is refused.
ROPE_KEYS = frozenset(
    {"rope_theta", "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor"}
    | {"original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow"}
    | {"mscale", "mscale_all_dim", "truncate", "short_factor", "long_factor"}
    | {"partial_rotary_factor", "mrope_section"}
)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / `rope_scaling`), with HF's defaults
    (transformers' modeling_rope_utils); worker_service.models.rope computes the frequencies."""

    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope
    max_position_embeddings: int = 2048  # the model's; dynamic and longrope read it
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale (None: from factor)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope, one per rotary frequency
    long_factor: tuple[float, ...] = ()  # longrope
    partial_rotary_factor: float = 1.0  # the first int(head_dim * this) dims rotate
    # M-RoPE (Qwen2-VL): rotary frequencies per position axis (temporal, height, width);
    # served only by the classes that declare the "mrope_section" feature.
    mrope_section: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
            )
        if self.rope_type in ("linear", "dynamic") and self.factor < 1.0:
            raise ValueError(f"rope_scaling factor must be >= 1 for {self.rope_type}")
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor):
            raise ValueError("longrope rope_scaling needs short_factor and long_factor")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError("partial_rotary_factor must be in (0, 1]")

    @property
    def length_dependent(self) -> bool:
        """True when a token's frequencies depend on its sequence's length (dynamic, longrope)."""
        return self.rope_type in ("dynamic", "longrope")


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes and options of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    # Attention/MLP features the config switches on beyond the Llama baseline (see
    # attention_features); a model class serves only those it declares.
    features: tuple[str, ...] = ()
    # Per layer: its sliding attention window (0: full attention); empty without windows.
    sliding_windows: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rope_recompute_length(self) -> int:
        """Phi-3 with longrope: the pretraining length past which HF's generate recomputes
        the whole cache with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation),
        so every key of a longer sequence is rotated with them; 0 for other models."""
        if self.architecture == "Phi3ForCausalLM" and self.rope.rope_type == "longrope":
            return self.rope.original_max_position_embeddings
        return 0

    @property
    def raw_text(self) -> dict[str, Any]:
        """config.json with a VLM's text_config merged in (the language model's fields)."""
        return {**self.raw, **self.raw.get("text_config", {})}

    @property
    def max_positions(self) -> int:
        """Longest sequence served: max_position_embeddings, stretched by a linear, dynamic or
        yarn rope factor (yarn: of the pretraining length), as vLLM derives max_model_len."""
        rope = self.rope
        if rope.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * rope.factor)
        if rope.rope_type == "yarn":
            stretched = int(rope.original_max_position_embeddings * rope.factor)
            return max(self.max_position_embeddings, stretched)
        return self.max_position_embeddings


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope(cfg: dict[str, Any], params: dict[str, Any] | None = None) -> RopeConfig:
    """RopeConfig of an HF config (or of one of its per-layer-type rope dicts, `params`);
    ValueError naming any key or type this server does not implement."""
    if params is None:
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
            params = dict(params.get("full_attention") or next(iter(params.values())))
    unknown = sorted(set(params) - ROPE_KEYS)
    if unknown:
        raise ValueError(f"unsupported rope_scaling key(s) {unknown} in config.json")
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type == "mrope":
        rope_type = "default"  # Qwen2-VL's old name, as transformers reads it
    if rope_type in ("su", "yarn") and cfg.get("model_type") == "phi3":
        rope_type = "longrope"  # Phi-3's old names, as transformers reads them
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    # Phi-3 keeps the pretraining length outside the rope dict; it wins there (as in HF)
    original = cfg.get("original_max_position_embeddings")
    original = original or params.get("original_max_position_embeddings") or max_pos
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    values: dict[str, Any] = {
        "theta": float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        "rope_type": rope_type,
        "original_max_position_embeddings": int(original),
        "max_position_embeddings": max_pos,
        "partial_rotary_factor": float(prf if prf is not None else 1.0),
        "truncate": bool(params.get("truncate", True)),
    }
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        values["factor"] = max_pos / int(original)  # HF's default: the stretch of the context
    floats: tuple[str, ...] = ("factor", "low_freq_factor", "high_freq_factor", "mscale")
    floats += ("attention_factor", "mscale_all_dim")
    values.update({k: float(params[k]) for k in floats if params.get(k) is not None})
    for key in ("beta_fast", "beta_slow"):  # HF: `or` default, so 0 means the default too
        if params.get(key):
            values[key] = float(params[key])
    for key in ("short_factor", "long_factor"):
        if params.get(key):
            values[key] = tuple(float(v) for v in params[key])
    if params.get("mrope_section"):
        values["mrope_section"] = tuple(int(v) for v in params["mrope_section"])
    return RopeConfig(**values)


def layer_type_rope(cfg: ModelArchConfig, layer_type: str) -> RopeConfig:
    """The rope of `layer_type` layers (Gemma 3's nested rope_parameters, or its older
    rope_local_base_freq for sliding layers); the model's own rope otherwise."""
    text = cfg.raw_text
    nested = text.get("rope_parameters") or {}
    if isinstance(nested.get(layer_type), dict):
        return _rope(text, dict(nested[layer_type]))
    if layer_type == "sliding_attention" and text.get("rope_local_base_freq") is not None:
        return _rope(text, {"rope_type": "default", "rope_theta": text["rope_local_base_freq"]})
    return cfg.rope


def read_model_config(model_dir: Path) -> ModelArchConfig:
    """Parse `model_dir/config.json` (and generation_config.json for EOS ids)."""
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or [_ARCH_BY_TYPE.get(raw.get("model_type", ""), "")]
    cfg = {**raw, **raw.get("text_config", {})}  # a VLM keeps its LM's shapes in text_config
    heads = int(cfg["num_attention_heads"])
    eos = _ids(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos += [
            t for t in _ids(json.loads(gen_path.read_text()).get("eos_token_id")) if t not in eos
        ]
    return ModelArchConfig(
        architecture=str(archs[0]),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=_rope(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)),
        eos_token_ids=tuple(eos),
        features=attention_features(cfg),
        sliding_windows=layer_windows(cfg),
        raw=raw,
    )


def _sliding(cfg: dict[str, Any]) -> bool:
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", True):
        return False
    if int(window) >= int(cfg.get("max_position_embeddings", 2048)):
        return False  # a window as long as any sequence excludes nothing
    types = cfg.get("layer_types")
    return types is None or "sliding_attention" in types


# feature name (the config field) -> whether the config switches it on
_FEATURE_TESTS = {
    "sliding_window": _sliding,
    "layer_types": lambda c: any(
        t not in ("full_attention", "sliding_attention") for t in c.get("layer_types") or []
    ),
    "attn_logit_softcapping": lambda c: c.get("attn_logit_softcapping") is not None,
    "final_logit_softcapping": lambda c: c.get("final_logit_softcapping") is not None,
    "attention_chunk_size": lambda c: c.get("attention_chunk_size") is not None,
    "mlp_bias": lambda c: bool(c.get("mlp_bias")),
    "hidden_act": lambda c: c.get("hidden_act") not in (None, "silu"),
    "hidden_activation": lambda c: c.get("hidden_activation") not in (None, "gelu_pytorch_tanh"),
    "no_rope_layers": lambda c: not all(c.get("no_rope_layers") or [1]),
    "mrope_section": lambda c: bool(
        isinstance(r := c.get("rope_parameters") or c.get("rope_scaling"), dict)
        and r.get("mrope_section")
    ),
}


def layer_windows(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window as HF applies it (0: full attention), () when none is:
    `layer_types` where given, else Qwen2's max_window_layers rule, else every layer."""
    if not _sliding(cfg):
        return ()
    window, layers = int(cfg["sliding_window"]), int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None and cfg.get("model_type") == "qwen2":  # layers from max_window_layers on
        first = int(cfg.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None:
        return (window,) * layers
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def attention_features(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The features of `cfg` (an HF text config) beyond a plain Llama decoder."""
    return tuple(name for name, test in _FEATURE_TESTS.items() if test(cfg))


_ARCH_BY_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
