"""The fused (grouped) CPU MoE path against a per-token loop, side by side.

    python -m benchmarks.moe_bench [--hidden 512] [--intermediate 1024] [--experts 8]
        [--top-k 2] [--batches 1 32] [--dtypes float32 bfloat16 bfloat16-f32] [--repeats 7] [--threads 1]

One random MoE layer (router + stacked experts, as worker_service.models.moe holds them).
Per batch size and dtype: `fused` is `fused_moe_torch` (pairs sorted by expert, one GEMM
per expert hit, weighted index_add); `per_token` loops over tokens and their k experts in
Python, one GEMV pair each. Both run on the same inputs, alternating within each repeat;
the figure is the median wall time of `repeats` runs and the ratio per_token / fused.
One torch thread by default: on a shared machine, multi-threaded GEMMs and index_add
stall on descheduled OpenMP threads (measured: 2 threads under load made one 8x512x2048
GEMM take 30 ms instead of 0.3 ms), which measures the neighbours, not the kernels.
Writes bench-results/moe.json and moe.md with the CPU (model, avx2/avx512 flags).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.report import RESULTS_DIR, cpu_info, cpu_line, markdown_table, write_results
from worker_service.models.moe import fused_moe_torch, select_experts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bfloat16-f32": torch.bfloat16}
# "bfloat16-f32": bf16 activations, experts upcast to float32 once (FusedMoE.pack on CPUs
# without native bf16 GEMMs, as the worker does on AVX2); the loop runs on the bf16 weights
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def per_token_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The loop reference: every token, every chosen expert, one GEMV pair at a time."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = F.linear(x[t : t + 1], w13[e]).split(inter, dim=-1)
            out[t] += (F.linear(F.silu(gate) * up, w2[e]) * weights[t, slot]).to(x.dtype)[0]
    return out


def make_inputs(args: argparse.Namespace, batch: int, dtype: torch.dtype) -> Inputs:
    gen = torch.Generator().manual_seed(batch)
    e, h, inter = args.experts, args.hidden, args.intermediate
    x = torch.randn(batch, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(batch, e, generator=gen).to(dtype)
    weights, ids = select_experts(logits, args.top_k, True, False)
    return x, w13, w2, weights, ids


def time_ms(fn: Callable[..., torch.Tensor], inputs: Inputs) -> float:
    start = time.perf_counter()
    fn(*inputs)
    return (time.perf_counter() - start) * 1e3


def bench_case(args: argparse.Namespace, batch: int, dtype_name: str) -> dict[str, Any]:
    """Median ms of both paths on one input (after one warm-up each), and their agreement."""
    inputs = make_inputs(args, batch, DTYPES[dtype_name])
    x, w13, w2, weights, ids = inputs
    packed = (x, w13.float(), w2.float(), weights, ids) if dtype_name.endswith("f32") else inputs
    with torch.inference_mode():
        fused, loop = fused_moe_torch(*packed), per_token_moe(*inputs)  # warm-up
        diff = float((fused.float() - loop.float()).abs().max())
        times: dict[str, list[float]] = {"fused": [], "per_token": []}
        for _ in range(args.repeats):  # alternate, so drift on a shared machine hits both
            times["fused"].append(time_ms(fused_moe_torch, packed))
            times["per_token"].append(time_ms(per_token_moe, inputs))
    fused_ms, loop_ms = (statistics.median(times[k]) for k in ("fused", "per_token"))
    return {"batch": batch, "dtype": dtype_name, "fused_ms": fused_ms, "per_token_ms": loop_ms,
            "speedup": loop_ms / fused_ms, "max_abs_diff": diff}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [bench_case(args, b, d) for d in args.dtypes for b in args.batches]
    cpu = cpu_info()
    shape = {k: getattr(args, k) for k in ("hidden", "intermediate", "experts", "top_k", "repeats")}
    data = {"cpu": cpu, "torch_threads": torch.get_num_threads(), "shape": shape, "rows": rows}
    title = (f"MoE layer (hidden {args.hidden}, {args.experts} experts x {args.intermediate}, "
             f"top-{args.top_k}), median of {args.repeats} runs, {torch.get_num_threads()} threads")  # fmt: skip
    columns = ["dtype", "batch", "fused_ms", "per_token_ms", "speedup", "max_abs_diff"]
    table = f"{title}\n\n{cpu_line(cpu)}\n\n" + markdown_table(rows, columns)
    write_results("moe", data, table, args.out_dir)
    print(table)
    return data


if __name__ == "__main__":
    main()
