"""Multi-LoRA configuration (vLLM's engine args of the same names), validated on construction."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class LoRAModule:
    """One adapter served from the start (`--lora-modules name=path`)."""

    name: str
    path: str
    # The model it adapts, as /v1/models names its parent; empty: the served base model.
    base_model_name: str = ""

    def __post_init__(self) -> None:
        _require(bool(self.name) and bool(self.path), "a LoRA module needs a name and a path")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's engine args of the same names)."""

    # Serve LoRA adapters beside the base model; off: requests naming one are refused.
    enable_lora: bool = False
    # Adapters a single step may mix: the workers' adapter slots, the scheduler's cap on
    # distinct adapters in the running batch.
    max_loras: int = 1
    # Largest adapter rank; slots are zero-padded to it (a larger rank is refused at load).
    max_lora_rank: int = 16
    # Adapters a worker keeps loaded in host memory (LRU); 0 means max_loras.
    max_cpu_loras: int = 0
    # Adapters served from the start, by name.
    lora_modules: tuple[LoRAModule, ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING, here a flag).
    allow_runtime_lora_updating: bool = False

    @property
    def cpu_loras(self) -> int:
        return max(self.max_cpu_loras, self.max_loras)

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras must be >= 1")
        _require(self.max_lora_rank >= 1, "max_lora_rank must be >= 1")
        _require(self.max_cpu_loras >= 0, "max_cpu_loras must be >= 0 (0: max_loras)")
        _require(
            not self.max_cpu_loras or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras must be >= max_loras",
        )
        names = [m.name for m in self.lora_modules]
        _require(len(names) == len(set(names)), "lora_modules names must be unique")
        _require(
            self.enable_lora or not (self.lora_modules or self.allow_runtime_lora_updating),
            "lora_modules and allow_runtime_lora_updating need enable_lora",
        )


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path` or vLLM's JSON form `{"name": .., "path": .., "base_model_name": ..}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            return LoRAModule(spec["name"], spec["path"], spec.get("base_model_name") or "")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"bad --lora-modules JSON {text!r}: {exc}") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path or JSON, not {text!r}")
    return LoRAModule(name, path)


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """The LoRA flags (vLLM's names); every service takes them, `tessera serve` passes them
    on with `lora_flags`."""
    d = LoRAConfig()
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help='adapters to serve: name=path or JSON {"name": .., "path": .., "base_model_name": ..}',
    )
    p.add_argument(
        "--max-loras", type=int, default=d.max_loras, help="adapters one step may mix (slots)"
    )
    p.add_argument(
        "--max-lora-rank", type=int, default=d.max_lora_rank, help="largest adapter rank"
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=d.max_cpu_loras,
        help="adapters kept in host memory (0: max_loras)",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )


def lora_from_args(args: argparse.Namespace) -> LoRAConfig:
    """The `add_lora_args` options of `args` (ValueError on bad values)."""
    return LoRAConfig(
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=tuple(parse_lora_module(m) for m in args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )


def lora_flags(args: argparse.Namespace) -> list[str]:
    """The LoRA options of `args` as service flags (checked here, before anything starts)."""
    config = lora_from_args(args)
    if not config.enable_lora:
        return []
    flags = ["--enable-lora", "--max-loras", str(config.max_loras)]
    flags += ["--max-lora-rank", str(config.max_lora_rank)]
    flags += ["--max-cpu-loras", str(config.max_cpu_loras)]
    if config.lora_modules:
        flags += [
            "--lora-modules",
            *(json.dumps(dataclasses.asdict(m)) for m in config.lora_modules),
        ]
    if config.allow_runtime_lora_updating:
        flags.append("--allow-runtime-lora-updating")
    return flags
