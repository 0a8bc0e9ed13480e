"""Does the worker's memory grow per request, or per new batch shape?

`python -m benchmarks.rss_probe [--rounds N] [--same] [--mode seeded|greedy|random]` runs the
engine and the real worker in this process (tessera.LLM, default model) on soak-like chat
prompts, 64 per round, and prints RSS and the number of live Python objects after each
round, with glibc's bytes in use and free in its heaps (mallinfo2: growth in use is memory
something keeps; growth in free is fragmentation), then RSS after glibc's malloc_trim. `--same` repeats one round's exact prompts and
lengths with prefix caching off, so every round schedules the same batch shapes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import time
from typing import Any

from services.types import SamplingParams

MODES: dict[str, dict[str, Any]] = {
    "seeded": {"temperature": 0.8},  # + seed per request, as the soak sends
    "greedy": {"temperature": 0.0},
    "random": {"temperature": 0.8},
}


class MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2`, summed over every arena."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def heap_mb() -> tuple[float, float]:
    """(MB in use, MB free) in glibc's heaps, outside its mmapped blocks."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks / 2**20, info.fordblks / 2**20


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def round_requests(rng: random.Random, first: int, mode: str) -> tuple[list[str], list[Any]]:
    """64 prompts of varied length and their sampling params."""
    prompts, params = [], []
    for i in range(first, first + 64):
        words = " more" * rng.randint(0, 40)
        prompts.append(f"Request {i}: write one sentence about the number {i % 97}.{words}")
        seed: dict[str, Any] = {"seed": i} if mode == "seeded" else {}
        params.append(SamplingParams(max_tokens=rng.randint(4, 24), **MODES[mode], **seed))
    return prompts, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--same", action="store_true", help="identical rounds, prefix caching off")
    p.add_argument("--mode", choices=sorted(MODES), default="seeded")
    args = p.parse_args()
    from tessera.llm import LLM

    llm = LLM(max_num_seqs=32, kv_cache_memory="512MiB", enable_prefix_caching=not args.same)
    rng = random.Random(0)
    for r in range(args.rounds):
        if args.same:
            rng = random.Random(0)
        prompts, params = round_requests(rng, 1 + 64 * r, args.mode)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        gc.collect()
        elapsed = time.perf_counter() - start
        used, free = heap_mb()
        print(
            f"round {r}: rss {rss_mb():.1f} MB (heap in use {used:.0f}, free {free:.0f}), "
            f"{len(gc.get_objects())} objects, {elapsed:.1f}s"
        )
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(f"after malloc_trim: rss {rss_mb():.1f} MB")


if __name__ == "__main__":
    main()
