"""Multi-LoRA configuration (vLLM's engine args of the same names), validated on construction."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from services.flags import flag


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


def show_lora_module(module: LoRAModule) -> str:
    """The --lora-modules text that parses back to `module` (vLLM's JSON form)."""
    return json.dumps(dataclasses.asdict(module))


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's engine args of the same names)."""

    enable_lora: bool = flag(
        False, "Serve LoRA adapters beside the base model; off: requests naming one are refused."
    )
    max_loras: int = flag(
        1,
        "Adapters one step may mix: the workers' adapter slots, the scheduler's cap on distinct "
        "adapters in the running batch.",
    )
    max_lora_rank: int = flag(
        16, "Largest adapter rank; slots are zero-padded to it (a larger rank is refused at load)."
    )
    max_cpu_loras: int = flag(
        0, "Adapters a worker keeps loaded in host memory (LRU); 0: max_loras."
    )
    lora_modules: tuple[LoRAModule, ...] = flag(
        (),
        'Adapters served from the start: name=path or JSON {"name": .., "path": .., '
        '"base_model_name": ..}.',
        nargs="+",
        metavar="NAME=PATH",
        parse=parse_lora_module,
        show=show_lora_module,
    )
    allow_runtime_lora_updating: bool = flag(
        False,
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING, here a flag).",
    )

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
