"""`LLM.embed`'s outputs and its run loop (vLLM's EmbeddingRequestOutput shape).

from tessera import LLM, PoolingParams
llm = LLM(runner="pooling")  # or task="embed"
out = llm.embed(["a sentence", "another"], PoolingParams(normalize=True))
vector = out[0].outputs.embedding  # list[float]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.types import EngineCoreOutput, FinishReason


@dataclass
class EmbeddingOutput:
    """One prompt's pooled vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of one prompt of `LLM.embed`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def decode_vector(data: bytes) -> list[float]:
    """The pooled vector the engine sends: little-endian float32 bytes."""
    values: list[float] = np.frombuffer(data, dtype="<f4").tolist()
    return values


def embedding_result(
    request_id: str, prompt_ids: list[int], last: EngineCoreOutput | None
) -> EmbeddingRequestOutput:
    """The output of a finished embedding request; RuntimeError when it failed."""
    if last is None or last.finish_reason != FinishReason.STOP or not last.pooling_output:
        reason = FinishReason(last.finish_reason).name if last else "no output"
        detail = (last.error if last else "") or reason
        raise RuntimeError(f"embedding request {request_id} failed: {detail}")
    vector = decode_vector(last.pooling_output)
    return EmbeddingRequestOutput(request_id, EmbeddingOutput(vector), prompt_ids)
