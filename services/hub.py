"""Models named by a Hugging Face Hub id ("org/name"), as `vllm serve org/name` takes them.

The local Hugging Face cache is searched first; a model missing from it is downloaded
(with a progress bar) unless HF_HUB_OFFLINE is set. Only the files the loader reads are
fetched: weights as safetensors, the config, the tokenizer, the generation config, the chat
template and the image processor's config. HF_TOKEN, HF_HOME and HF_HUB_CACHE are read when a
model is resolved, never at import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from services.config import HubConfig

# What the loader, the tokenizer and the multimodal processor read; never *.bin/*.pt/*.gguf.
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as "org/name" and names no local path."""
    return _HUB_ID.fullmatch(model) is not None and not Path(model).expanduser().exists()


def cache_dir(hub: HubConfig, environ: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache to use: --download-dir, HF_HUB_CACHE, HF_HOME/hub, default."""
    env = os.environ if environ is None else environ
    if hub.download_dir:
        return Path(hub.download_dir).expanduser()
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def offline(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def resolve_hub_model(model_id: str, hub: HubConfig) -> Path:
    """The local snapshot of `model_id` at `hub.revision`: cached, else downloaded.

    FileNotFoundError names the id, the revision and the cache searched when the model is
    neither cached nor obtainable (offline, unknown id or revision, no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = cache_dir(hub)
    where = f"{model_id!r}" + (f" at revision {hub.revision!r}" if hub.revision else "")
    try:
        path = snapshot_download(
            model_id,
            revision=hub.revision or None,
            cache_dir=cache,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline(),
        )
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline() else "the Hub could not be reached"
        raise FileNotFoundError(
            f"model {where} is not in the Hugging Face cache {cache} and {why}; "
            "download it first (huggingface-cli download) or give a local directory"
        ) from None
    except HfHubHTTPError as exc:  # unknown repository or revision, gated, ...
        first = str(exc).splitlines()[0]
        raise FileNotFoundError(f"model {where} cannot be fetched: {first}") from None
    snapshot = Path(path)
    if not (snapshot / "config.json").is_file():
        raise FileNotFoundError(f"model {where} in {cache} has no config.json")
    return snapshot
