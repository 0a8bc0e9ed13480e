"""A tiny random Llama (no tokenizer) and an in-process engine over it, for the speculative
decoding tests: real worker, real scheduler, no gRPC."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scheduler_service.engine import EngineCore
from services.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)
from services.types import EngineCoreOutput, EngineCoreRequest, SamplingParams

VOCAB = 24
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def save_tiny_llama(path: Path, logit_scale: float = 1.0) -> Path:
    """A 2-layer Llama with a 24-token vocabulary; `logit_scale` sharpens its next-token
    distributions (random init alone gives nearly uniform ones)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    model: Any = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    return path


class TinyEngine:
    """EngineCore + Worker in this process; `generate` runs requests to the end."""

    def __init__(
        self,
        model_dir: Path,
        spec: SpeculativeConfig | None,
        *,
        num_blocks: int = 256,
        block_size: int = 4,
        max_num_seqs: int = 256,
        seed: int = 0,
    ) -> None:
        from worker_service.worker import Worker

        cache = CacheConfig(block_size=block_size, num_blocks_override=num_blocks)
        self.worker = Worker(
            WorkerConfig(
                model=ModelConfig(model=str(model_dir), dtype="float32", seed=seed),
                cache=cache,
                max_num_seqs=max_num_seqs,
                speculative_config=spec,
            )
        )
        scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, speculative_config=spec)
        self.engine = EngineCore(scheduler, cache, [self.worker])
        self._next = 0

    def add(self, prompt: list[int], params: SamplingParams) -> str:
        request_id = str(self._next)
        self._next += 1
        self.engine.add_request(EngineCoreRequest(request_id, prompt, params))
        return request_id

    def run(self) -> dict[str, list[EngineCoreOutput]]:
        """Step until idle; the updates per request id."""
        outputs: dict[str, list[EngineCoreOutput]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        ids = [self.add(p, params) for p in prompts]
        outputs = self.run()
        return [[t for o in outputs[i] for t in o.new_token_ids] for i in ids]

    def close(self) -> None:
        self.engine.shutdown()
        self.worker.shutdown()
