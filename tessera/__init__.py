"""Tessera: the CLI and the offline API (`from tessera import LLM, SamplingParams`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.types import (
    LoRARequest,
    SamplingParams,
    StructuredOutputParams,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    from tessera.llm import LLM, CompletionOutput, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    """Import the offline API lazily: `tessera serve` must not load torch in the launcher."""
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from tessera import llm

        return getattr(llm, name)
    raise AttributeError(name)
