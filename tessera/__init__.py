"""Tessera: the CLI and the offline API (`from tessera import LLM, SamplingParams`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.types import (
    LoRARequest,
    PoolingParams,
    SamplingParams,
    StructuredOutputParams,
    StructuredOutputsParams,
)
from tessera.logprobs import Logprob

if TYPE_CHECKING:
    from tessera.embed import EmbeddingOutput, EmbeddingRequestOutput
    from tessera.llm import LLM, CompletionOutput, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
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
    if name in ("EmbeddingOutput", "EmbeddingRequestOutput"):
        from tessera import embed

        return getattr(embed, name)
    raise AttributeError(name)
