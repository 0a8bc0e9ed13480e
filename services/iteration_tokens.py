"""Engine steps by the tokens they scheduled: a histogram the scheduler keeps as running
totals (`SchedulerStats.iteration_tokens_*`) and the gateway exports as vLLM's
`vllm:iteration_tokens_total`, with vLLM's bucket bounds."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# vLLM's upper bounds (vllm/v1/metrics/loggers.py); a last bucket counts steps above them.
BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TokenHistogram:
    """Counts of steps per bucket of BUCKETS (+1 past the last) and the sum of their tokens."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect.bisect_left(BUCKETS, num_tokens)] += 1
        self.sum += num_tokens


def add_counts(lists: Sequence[Sequence[int]]) -> list[int]:
    """Bucket counts of several sources added bucket by bucket (an empty list adds nothing)."""
    width = max((len(c) for c in lists), default=0)
    return [sum(c[i] for c in lists if i < len(c)) for i in range(width)]
