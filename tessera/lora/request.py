"""`from tessera.lora.request import LoRARequest`, as `from vllm.lora.request import LoRARequest`."""

from services.types import LoRARequest

__all__ = ["LoRARequest"]
