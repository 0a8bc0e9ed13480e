"""What the config dataclasses share: sizes, runner names, the flags two configs declare."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from services.flags import Flag

REASONING_PARSERS = ("qwen3", "deepseek_r1")  # gateway.reasoning
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")  # gateway.tool_parsers
DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct (services.default_model)
GiB = 1 << 30
SCHEDULER_PORT = 50051  # where a scheduler listens unless told otherwise
WORKER_PORT = 50061  # where a worker listens unless told otherwise
TOKEN_ENV = "TESSERA_INTERNAL_TOKEN"  # the internal token, when --internal-token is not given
API_KEY_ENV = "TESSERA_API_KEY"  # the gateway's client API key, when --api-key is not given

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bytes(text: str | int) -> int:
    """Parse a size such as 4GiB, 512MiB, 2G or 1073741824 into bytes.
    A bare number below 1024 is read as GiB (`--kv-cache-memory 4` means 4 GiB)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size (try 4GiB, 512MiB or a byte count)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if not unit:
        return int(number * GiB) if number < 1024 else int(number)
    base = 1024 if "i" in unit else 1000
    power = "bkmgt".index(unit[0]) if unit[0] != "b" else 0
    return int(number * base**power) if unit[0] != "b" else int(number)


def format_bytes(size: int) -> str:
    """A byte count as parse_bytes reads it back: 2GiB, 512MiB, or the bare count."""
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


BYTES = {"parse": parse_bytes, "show": format_bytes}  # flag options of a size in bytes


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_network(text: str) -> bool:
    """Whether `text` is an IP network such as 10.0.0.0/8 or fd00::/8 (or one address)."""
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


Runner = Literal["generate", "pooling"]
RUNNERS: tuple[Runner, ...] = ("generate", "pooling")
TASKS = {"generate": "generate", "embed": "pooling", "embedding": "pooling"}  # --task aliases


def resolve_runner(runner: str | None, task: str | None) -> Runner:
    """The runner from vLLM's `--runner` or its older `--task` (embed -> pooling); both given
    must agree. ValueError for an unknown name."""
    if task is not None and task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, not {task!r}")
    from_task = TASKS[task] if task is not None else None
    if runner is not None and from_task is not None and runner != from_task:
        raise ValueError(f"runner {runner!r} contradicts task {task!r}")
    chosen = runner or from_task or "generate"
    for known in RUNNERS:
        if chosen == known:
            return known
    raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, not {chosen!r}")


QUANTIZATIONS = ("none", "int8", "int4", "gguf", "awq", "gptq")  # ModelConfig.quantization
QUANTIZATION_GROUP_SIZES = (32, 64, 128)  # ModelConfig.quantization_group_size (int4)
# Flags two configs share (one declaration each).
MODEL = Flag(
    DEFAULT_MODEL,
    "HF model directory, Hub id (org/name), or 'default' (the embedded SmolLM2-135M-Instruct).",
)
SERVED_MODEL_NAME = Flag(
    "", "Name clients use in `model`; empty: from the model (the gateway: the scheduler's)."
)
HOST = Flag("127.0.0.1", "Interface to listen on (the gateway: HTTP and gRPC).")
MAX_NUM_SEQS = Flag(256, "Most requests in one step (the running set's cap).")
MAX_NUM_BATCHED_TOKENS = Flag(
    2048, "Token budget of one step, decode tokens plus prefill chunks; the workers prepare for it."
)

ROUTINGS = ("affinity", "round-robin")  # how a gateway spreads requests over engine replicas
