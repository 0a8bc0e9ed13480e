"""The adapters a gateway serves: the `model` name -> LoRARequest, /v1/models entries, and
the runtime /v1/load_lora_adapter and /v1/unload_lora_adapter endpoints (vLLM's).

Each load gets a fresh lora_int_id (the workers' cache key and part of the prefix hash),
so an adapter unloaded and loaded again under its name never meets its old KV or weights.
Unloading only stops new requests naming it; requests already running finish with it,
as in vLLM.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.errors import InvalidRequest, NotFound
from gateway.http_io import read_json
from services.lora_adapter import read_adapter_config
from services.lora_config import LoRAConfig
from services.types import LoRARequest

log = logging.getLogger(__name__)


class LoRARegistry:
    """Adapters by name, with the base model each one names as its parent."""

    def __init__(self, config: LoRAConfig) -> None:
        self.config = config
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self._ids = itertools.count(1)
        for module in config.lora_modules:  # a bad directory stops the gateway at start
            self.add(module.name, module.path, module.base_model_name)

    def add(self, name: str, path: str, parent: str = "") -> LoRARequest:
        """Serve the adapter at `path` as `name`; ValueError if it cannot be served."""
        if not self.config.enable_lora:
            raise ValueError("LoRA is not enabled (start with --enable-lora)")
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        read_adapter_config(path, self.config.max_lora_rank)
        request = LoRARequest(name, next(self._ids), path)
        self.adapters[name], self.parents[name] = request, parent
        log.info("LoRA adapter %r served from %s (id %d)", name, path, request.lora_int_id)
        return request

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise NotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
        del self.parents[name]
        log.info("LoRA adapter %r unloaded", name)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name else None

    def model_entries(self, base: dict[str, Any]) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters, shaped like the base model's `base`."""
        return [
            {**base, "id": name, "root": lora.lora_path, "parent": self.parents[name] or base["id"]}
            for name, lora in self.adapters.items()
        ]


class LoRARoutes:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only with
    --allow-runtime-lora-updating; otherwise the routes do not exist: 404)."""

    def __init__(self, registry: LoRARegistry, base_name: Any, max_body_bytes: int) -> None:
        self.registry, self.base_name, self.max_body_bytes = registry, base_name, max_body_bytes

    async def load(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if name == await self.base_name():
            raise InvalidRequest(f"'{name}' is the base model's name", "lora_name")
        try:
            self.registry.add(name, path)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("'lora_name' must be provided.", "lora_name")
        self.registry.remove(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
