"""Benchmark workloads: random token-id prompts from a fixed seed (like `vllm bench`)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    prompt_token_ids: list[int]
    output_len: int


def mixed_workload(
    num_requests: int = 64,
    prompt_len: tuple[int, int] = (64, 512),
    output_len: tuple[int, int] = (32, 256),
    vocab_size: int = 49152,
    seed: int = 0,
    avoid_ids: frozenset[int] = frozenset(range(17)),
) -> list[BenchRequest]:
    """The "mixed" workload: lengths uniform in the given inclusive ranges, random ids
    (special tokens such as EOS avoided so prompts are plain text)."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in avoid_ids]
    return [
        BenchRequest(
            prompt_token_ids=rng.choices(allowed, k=rng.randint(*prompt_len)),
            output_len=rng.randint(*output_len),
        )
        for _ in range(num_requests)
    ]
