"""How a model pools its hidden states into one embedding, read from its files (no torch).

As vLLM does (vllm.transformers_utils.config.get_pooling_config): a sentence-transformers
`modules.json` names a Pooling module whose `config.json` sets one `pooling_mode_*` flag
(mean_tokens, cls_token, lasttoken, max_tokens) and maybe a Normalize module; without one a
decoder pools its last token and normalizes. `dimensions` (Matryoshka truncation) is allowed
only for a model whose config.json has `matryoshka_dimensions` or `is_matryoshka`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.config import RUNNERS, TASKS, Runner, resolve_runner
from services.types import PoolingParams

PoolingType = Literal["LAST", "MEAN", "CLS", "MAX"]
_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_max_tokens": "MAX",
}
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolerConfig:
    """The model's pooling: which rows, whether to normalize, which truncations it allows."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True  # the default when a request leaves PoolingParams.normalize unset
    is_matryoshka: bool = False  # `dimensions` may truncate the vector
    matryoshka_dimensions: tuple[int, ...] | None = None  # the only allowed ones, if listed
    hidden_size: int = 0  # length of the full vector (0: unknown)

    def __post_init__(self) -> None:
        if self.pooling_type not in _MODES.values():
            raise ValueError(f"unknown pooling type {self.pooling_type!r}")


def read_pooler_config(model_dir: Path) -> PoolerConfig:
    """The pooling of the HF directory `model_dir` (ValueError for a mode Tessera lacks)."""
    config = _read_json(model_dir / "config.json") or {}
    dims = config.get("matryoshka_dimensions")
    base = PoolerConfig(
        is_matryoshka=bool(config.get("is_matryoshka")) or dims is not None,
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        hidden_size=int(config.get("hidden_size") or 0),
    )
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return base  # a decoder: last token, normalized
    types = {m.get("type"): m for m in modules if isinstance(m, dict)}
    normalize = _NORMALIZE_MODULE in types
    pooling = types.get(_POOLING_MODULE)
    if pooling is None:
        return dataclasses.replace(base, normalize=normalize)
    flags = _read_json(model_dir / str(pooling.get("path", "")) / "config.json") or {}
    modes = [name for name, on in flags.items() if name.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in _MODES:
        raise ValueError(
            f"{model_dir}: sentence-transformers pooling {modes or 'none'} is not supported "
            f"(one of {', '.join(_MODES)})"
        )
    return dataclasses.replace(base, pooling_type=_MODES[modes[0]], normalize=normalize)


def check_pooling_params(params: PoolingParams, config: PoolerConfig, model: str) -> None:
    """ValueError when `params` asks what the model cannot do (vLLM's wording)."""
    if params.dimensions is None:
        return
    if not config.is_matryoshka:
        raise ValueError(
            f'Model "{model}" does not support matryoshka representation, changing output '
            "dimensions will lead to poor results."
        )
    if config.hidden_size and params.dimensions > config.hidden_size:
        raise ValueError(
            f"dimensions ({params.dimensions}) must be at most the model's hidden size "
            f"({config.hidden_size})"
        )
    allowed = config.matryoshka_dimensions
    if allowed is not None and params.dimensions not in allowed:
        raise ValueError(
            f'Model "{model}" only supports {list(allowed)} matryoshka dimensions, using other '
            "output dimensions will lead to poor results."
        )


def add_runner_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's --runner and its older --task alias (`python -m worker_service`, tessera serve)."""
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        default=None,
        help="generate (completions, chat; the default) or pooling (/v1/embeddings)",
    )
    parser.add_argument(
        "--task", choices=list(TASKS), default=None, help="older spelling: embed = --runner pooling"
    )


def runner_from_args(args: argparse.Namespace) -> Runner:
    """The runner --runner / --task ask for (ValueError when they disagree)."""
    return resolve_runner(args.runner, args.task)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
