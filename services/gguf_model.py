"""GGUF files served as they are: `--model FILE.gguf` (or a directory holding one .gguf).

`prepare(path)` checks the file (readable, an architecture and tensor types Tessera serves)
and makes a small model directory under Tessera's cache: the config and tokenizer that
transformers reads from the GGUF metadata (with the file's chat template), and `model.gguf`,
a link to the file itself. Every service resolves the model to that directory; the worker
reads the weights from the linked file in their block formats (worker_service/gguf.py), so
no dequantized copy of the model is written or kept.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LINK_NAME = "model.gguf"
ARCHITECTURES = {"llama": "LlamaForCausalLM"}  # GGUF's name (Llama, Mistral, SmolLM2) -> HF's
# Tensor types the worker reads: float ones as they are, block ones by the GGUF GEMMs.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                "Q4_K", "Q5_K", "Q6_K")  # fmt: skip


class GGUFError(ValueError):
    """A GGUF file Tessera cannot serve; the message names the file and what is wrong."""


def find_gguf(model: str) -> Path | None:
    """The GGUF file `model` names: a .gguf file, or the one .gguf of a directory without a
    config.json; None for anything else (an HF directory, a Hub id, "default")."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path} holds {len(files)} .gguf files; name one of them")
        return files[0] if files else None
    return None


def prepare(path: Path, cache: Path) -> Path:
    """The model directory for the GGUF file at `path` (made once per file version)."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache / "gguf" / f"{path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    architecture = check(path)
    log.info("reading the config and tokenizer of %s (once)", path.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=target.parent))
    try:
        _write_config_and_tokenizer(path, tmp, architecture)
        (tmp / LINK_NAME).symlink_to(path)
        tmp.chmod(0o755)
        if not target.exists():
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check(path: Path) -> str:
    """The HF architecture of the GGUF file at `path`, after checking that every tensor has
    a type Tessera reads (GGUFError otherwise)."""
    reader = open_reader(path)
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "(none)"
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {arch!r} is not served by Tessera "
            f"(served: {', '.join(ARCHITECTURES)})"
        )
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in TENSOR_TYPES:
            raise GGUFError(
                f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}, a type Tessera "
                f"does not read yet (it reads {', '.join(TENSOR_TYPES)})"
            )
    return ARCHITECTURES[arch]


def open_reader(path: Path) -> Any:
    """gguf's reader over `path`, or GGUFError naming the file when it cannot be read."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc


def _write_config_and_tokenizer(path: Path, out: Path, architecture: str) -> None:
    """config.json, generation_config.json and the tokenizer files, from the GGUF metadata."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.architectures = [architecture]
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
