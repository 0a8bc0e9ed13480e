"""The GGUF block GEMMs (worker_service/models/gguf_gemm.h) on the default model's shapes.

    python -m benchmarks.gguf_gemm_bench [--level AVX2] [--repeats 7] [--threads N] [--types Q4_0,Q6_K]

For each block format Tessera reads and batch 1 and 32 (float32 activations): the median
time of one x [rows, K] @ W [N, K].T over shapes like the default model's MLP (gate/up fused
3072 x 768, down 576 x 1536: K a multiple of the K-quants' 256) and the weight bytes read per
second. Writes
bench-results/gguf_gemm.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.report import cpu_info, cpu_line, markdown_table, write_results
from worker_service.models import cpu_ops, quant

SHAPES = [(3072, 768), (576, 1536)]  # [N, K]: gate/up and down (576 -> 768, whole 256s)
# Byte offsets of each format's IEEE half scales in its block (set to small finite values).
HALVES = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}


def random_blocks(ggml_type: int, n: int, k: int) -> torch.Tensor:
    """[n, k / block * bytes] uint8: random values, small finite half scales."""
    size, nbytes = quant.BLOCK_SIZE[ggml_type], quant.BLOCK_BYTES[ggml_type]
    raw = torch.randint(0, 256, (n, k // size, nbytes), dtype=torch.uint8)
    for at in HALVES[ggml_type]:
        scale = (torch.rand(n, k // size, 1) * 0.01 + 0.001).half()
        raw[..., at : at + 2] = scale.view(torch.uint8)
    return raw.reshape(n, -1)


def time_gemm(ops: cpu_ops.CpuOps, ggml_type: int, rows: int, repeats: int) -> float:
    """Median seconds of one pass over SHAPES."""
    weights = [random_blocks(ggml_type, n, k) for n, k in SHAPES]
    xs = [torch.randn(rows, k) for _, k in SHAPES]
    for x, w in zip(xs, weights, strict=True):  # warm-up: threads, caches
        ops.gemm_gguf(x, w, ggml_type, None)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            for x, w in zip(xs, weights, strict=True):
                ops.gemm_gguf(x, w, ggml_type, None)
        times.append((time.perf_counter() - start) / 10)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--level", default=None, help="native build level (default: this CPU's)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--types", default=",".join(quant.TYPE_NAMES.values()))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = cpu_ops.build(args.level)
    by_name = {name: t for t, name in quant.TYPE_NAMES.items()}
    rows_out: list[dict[str, Any]] = []
    for name in args.types.split(","):
        t = by_name[name]
        nbytes = sum(n * k // quant.BLOCK_SIZE[t] * quant.BLOCK_BYTES[t] for n, k in SHAPES)
        for rows in (1, 32):
            sec = time_gemm(ops, t, rows, args.repeats)
            rows_out.append({"format": name, "batch": rows, "us": sec * 1e6,
                             "GB/s": nbytes / sec / 1e9})  # fmt: skip
    cpu = cpu_info()
    table = (f"GGUF block GEMMs, {' + '.join(f'{n}x{k}' for n, k in SHAPES)}, float32 x, "
             f"{torch.get_num_threads()} threads, {cpu_line(cpu)}\n\n"
             + markdown_table(rows_out, ["format", "batch", "us", "GB/s"]))  # fmt: skip
    write_results("gguf_gemm", {"cpu": cpu, "level": args.level, "rows": rows_out}, table)
    print(table)


if __name__ == "__main__":
    main()
