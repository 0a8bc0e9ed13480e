"""The CPU paged decode-attention kernel on a default-model decode step, against the
machine's read bandwidth.

    python -m benchmarks.attention_bench [--batch 48] [--context 500] [--level AVX2] [--layers 8]

One layer of a decode step (`--layers` pools read in turn, as a model's layers are):
`batch` requests, each with `context` cached tokens in
shuffled 16-token blocks, 9 query heads over 3 KV heads of 64 (SmolLM2-135M). For each
cache dtype: the median time of one kernel call and the KV bytes it reads per second,
beside `torch.sum` over a tensor of the same bytes (what the machine reads in one pass)
and their ratio (issue 20's target: >= 0.70 for bf16). Writes bench-results/attention.json
and .md and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.attention_cases import build_case
from benchmarks.report import cpu_info, cpu_line, markdown_table, write_results
from worker_service.attention import cpu_kernel, kv_quant

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def median_seconds(fn: Callable[[], object], repeats: int, inner: int = 20) -> float:
    """Median over `repeats` of the mean time of `inner` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def decode_step(batch: int, context: int, dtype: torch.dtype, cache: str) -> dict[str, Any]:
    """The kernel's arguments for one layer: (query, k, v, out, DecodeBatch, scale)."""
    case = build_case([(context, 1)] * batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype)
    k, v = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    if cache != "auto":
        pool = kv_quant.POOL_DTYPES[cache]
        shape = (*k.shape[:3], kv_quant.slot_width(HEAD_DIM, pool))
        qk, qv = (torch.zeros(shape, dtype=pool) for _ in range(2))
        flat = torch.arange(k.shape[0] * BLOCK)
        kv_quant.write(k.view(-1, KV_HEADS, HEAD_DIM), qk, flat)
        kv_quant.write(v.view(-1, KV_HEADS, HEAD_DIM), qv, flat)
        k, v = qk, qv
    meta = case.meta
    decode = cpu_kernel.DecodeBatch(
        block_table=meta.block_table.contiguous(),
        seq_lens=meta.seq_lens.contiguous(),
        reqs=torch.arange(batch),
        rows=torch.arange(batch),
    )
    row_bytes = k.shape[-1] * k.element_size()
    kv_bytes = 2 * batch * (context + 1) * KV_HEADS * row_bytes
    return {"query": case.query.contiguous(), "k": k, "v": v, "batch": decode,
            "scale": case.scale, "kv_bytes": kv_bytes}  # fmt: skip


def measure(
    lib: Any, steps: list[dict[str, Any]], flats: list[torch.Tensor], repeats: int
) -> tuple[float, float]:
    """Median seconds of one layer's call (the layers' pools taken in turn, as a model step
    reads them: each from memory, not from the cache the last call left) and of torch.sum
    over as many bytes, measured in alternation."""
    out = torch.empty_like(steps[0]["query"])

    def call() -> None:
        for step in steps:
            cpu_kernel.paged_decode(lib, step["query"], step["k"], step["v"], out,
                                    step["batch"], step["scale"])  # fmt: skip

    def read() -> None:
        for flat in flats:
            flat.sum()

    call()
    read()
    kernel, summed = [], []
    for _ in range(repeats):
        kernel.append(median_seconds(call, 1, inner=2) / len(steps))
        summed.append(median_seconds(read, 1, inner=2) / len(flats))
    return statistics.median(kernel), statistics.median(summed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--level", default=None, help="native build level (default: this CPU's)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--layers", type=int, default=8, help="pools read in turn")
    parser.add_argument("--caches", default="bf16,fp32,int8")
    args = parser.parse_args(argv)
    lib = cpu_kernel.build(args.level)
    rows: list[dict[str, Any]] = []
    for name in args.caches.split(","):
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        cache = "int8" if name == "int8" else "auto"
        steps = [decode_step(args.batch, args.context, dtype, cache) for _ in range(args.layers)]
        kv_bytes = steps[0]["kv_bytes"]
        flats = [torch.ones(kv_bytes // 4) for _ in range(args.layers)]
        sec, sum_sec = measure(lib, steps, flats, args.repeats)
        gbs, sum_gbs = kv_bytes / sec / 1e9, kv_bytes / sum_sec / 1e9
        rows.append({"cache": name, "us": sec * 1e6, "KV GB/s": gbs,
                     "torch.sum GB/s": sum_gbs, "ratio": gbs / sum_gbs})  # fmt: skip
    cpu = cpu_info()
    table = (f"Paged decode attention, one layer: batch {args.batch} x {args.context} tokens, "
             f"{HEADS} heads / {KV_HEADS} KV heads of {HEAD_DIM}, {torch.get_num_threads()} "
             f"threads, build {args.level or 'native'}, {cpu_line(cpu)}\n\n"
             + markdown_table(rows, ["cache", "us", "KV GB/s", "torch.sum GB/s", "ratio"]))  # fmt: skip
    write_results("attention", {"cpu": cpu, "level": args.level, "batch": args.batch,
                                "context": args.context, "rows": rows}, table)  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
