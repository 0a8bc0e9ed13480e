"""Prepared GPU check for the Triton kernels (run only on a CUDA machine).

1. Correctness: every case of tests/worker/test_attention_triton.py plus larger ones,
   Triton vs the reference backend on CUDA tensors.
2. Timing (median of CUDA-event timings): decode and prefill at realistic shapes, against
   torch SDPA on the same data unpaged as a yardstick.
3. The dequant GEMM over GGUF blocks (benchmarks/gpu_check_quant.py, report key
   "dequant_gemm"): correctness per format, timings against torch bf16 at M = 1 and 32,
   and a Q4_1 GGUF served on CUDA (`--gguf FILE`; the default model's when not given).
4. With `--throughput-config DIR`: the worker's decode and prefill speed on CUDA for a
   random-weight model of that config (report key "throughput").

On a GPU machine that reaches no registry: `python -m benchmarks.gpu_carry` here, then
`bash benchmarks/gpu_check.sh` there (it says what to carry).

Usage (from the repository root): `.venv/bin/python -m benchmarks.gpu_check [--out FILE]`
(`--only-dequant`: section 3 alone);
writes a JSON report to FILE (default: $OUT/gpu_check.json when OUT is set) and prints it.
Exit status 1 when a correctness case fails, 2 without a CUDA device. Needs torch with
CUDA, triton, numpy and pytest (the cases are shared with the tests). Untimed so far: expect
minutes at most, mostly Triton compiling one kernel variant per shape class.
The CUDA IPC tensor-handle test is separate:
`python -m pytest tests/foundation/test_tensor_handles.py -k cuda_ipc` (needs protobuf too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.attention_cases import ATTENTION_CASES, TRITON_BATCHES, build_case
from benchmarks.gpu_check_quant import correctness_section, model_check, timing_section
from benchmarks.report import markdown_table
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.reference import ReferenceAttentionBackend
from worker_service.attention.triton_backend import TritonAttentionBackend

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
LARGE_BATCHES = {
    "long_prefix_chunk": [(1000, 300), (2047, 1), (0, 517)],
    "many_decodes": [(n, 1) for n in range(1, 2000, 61)],
}


def correctness() -> list[dict[str, Any]]:
    """Triton vs reference on CUDA for the CI cases and a few large ones."""
    cases = [(TRITON_BATCHES, *c) for c in ATTENTION_CASES]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name in LARGE_BATCHES:
            cases.append((LARGE_BATCHES, name, 8, 4, 16, dtype, 128))
            cases.append((LARGE_BATCHES, name, 3, 3, 32, dtype, 64))
    return [check_case(*c) for c in cases]


def check_case(
    batches: dict[str, list[tuple[int, int]]],
    batch: str,
    kv_heads: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    head_dim: int,
    device: str = "cuda",
) -> dict[str, Any]:
    case = build_case(
        batches[batch], kv_heads * group, kv_heads, head_dim, block_size, dtype, device
    )
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    ref = ReferenceAttentionBackend()
    ref.write_kv(case.key, case.value, ref_k, ref_v, case.meta.slot_mapping)
    expected = ref.forward(case.query, ref_k, ref_v, case.meta, case.scale)
    tri = TritonAttentionBackend()
    tri.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = tri.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    err = (out.float() - expected.float()).abs().max().item()
    pools_equal = torch.equal(case.k_cache.nan_to_num(), ref_k.nan_to_num()) and torch.equal(
        case.v_cache.nan_to_num(), ref_v.nan_to_num()
    )
    ok = pools_equal and err <= TOLERANCE[dtype]
    label = f"{batch}/kv{kv_heads}x{group}/bs{block_size}/{dtype}/d{head_dim}"
    return {"case": label, "max_abs_err": err, "pools_equal": pools_equal, "ok": ok}


def timing_inputs(
    requests: list[tuple[int, int]],
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dev: str = "cuda",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random bf16 query/K/V and a paged pool laid out in shuffled blocks, built on `dev`.
    Returns (query, k_cache, v_cache, new-token K/V for write_kv timing, metadata)."""
    dtype = torch.bfloat16
    seq_lens = [c + n for c, n in requests]
    query_lens = [n for _, n in requests]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
    table = torch.zeros(len(requests), max(blocks), dtype=torch.int32, device=dev)
    slot_maps, start = [], 0
    for i, (n, (ctx, new)) in enumerate(zip(blocks, requests, strict=True)):
        table[i, :n] = perm[start : start + n]
        start += n
        pos = torch.arange(ctx, ctx + new, device=dev)
        slot_maps.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    pool = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(pool, dtype=dtype, device=dev)
    v_cache = torch.randn(pool, dtype=dtype, device=dev)
    query = torch.randn(sum(query_lens), kv_heads * group, head_dim, dtype=dtype, device=dev)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).to(
            dev, torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_table=table,
        slot_mapping=torch.cat(slot_maps),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return query, k_cache, v_cache, query[:, :kv_heads].contiguous(), meta


def median_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sdpa_yardstick(
    requests: list[tuple[int, int]], kv_heads: int, group: int, head_dim: int
) -> Callable[[], torch.Tensor]:
    """Roughly the same work as dense SDPA over a padded, unpaged batch (flash when it
    applies; a chunk after a prefix is timed without its causal mask). A yardstick only."""
    max_seq = max(c + n for c, n in requests)
    max_q = max(n for _, n in requests)
    q = torch.randn(len(requests), kv_heads * group, max_q, head_dim, device="cuda").bfloat16()
    k = torch.randn(len(requests), kv_heads * group, max_seq, head_dim, device="cuda").bfloat16()
    causal = max_q == max_seq
    return lambda: F.scaled_dot_product_attention(q, k, k, is_causal=causal)


TIMING_SHAPES = {
    "decode_b32_ctx1024": [(1023, 1)] * 32,
    "decode_b256_ctx1024": [(1023, 1)] * 256,
    "prefill_4x512": [(0, 512)] * 4,
    "chunk_1024_after_2048": [(2048, 1024)],
}


def timings() -> list[dict[str, Any]]:
    backend = TritonAttentionBackend()
    rows = []
    for name, requests in TIMING_SHAPES.items():
        for kv_heads, group, head_dim, block_size in [
            (8, 4, 128, 16),
            (3, 3, 64, 16),
            (8, 4, 128, 32),
        ]:
            q, kc, vc, new_kv, meta = timing_inputs(requests, kv_heads, group, head_dim, block_size)
            attn_ms = median_ms(lambda: backend.forward(q, kc, vc, meta, head_dim**-0.5))  # noqa: B023
            write_ms = median_ms(
                lambda: backend.write_kv(new_kv, new_kv, kc, vc, meta.slot_mapping)  # noqa: B023
            )
            sdpa_ms = median_ms(sdpa_yardstick(requests, kv_heads, group, head_dim))
            rows.append(
                {
                    "shape": name,
                    "heads": f"{kv_heads}x{group} d{head_dim} bs{block_size}",
                    "triton_attention_ms": round(attn_ms, 4),
                    "triton_write_kv_ms": round(write_ms, 4),
                    "sdpa_dense_padded_ms": round(sdpa_ms, 4),
                }
            )
    return rows


def throughput(config_dir: Path) -> dict[str, Any]:
    """Worker decode tok/s (batches 1/32/256, median of 3 x 32 steps) and a 512-token prefill,
    bf16, for a random-weight model of `config_dir`'s config (benchmarks/gpu_carry.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.decode_bench import WorkerBench

    model_dir = Path(tempfile.mkdtemp(prefix="gpu_check_model_"))
    for file in config_dir.iterdir():
        shutil.copy(file, model_dir / file.name)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_dir)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
    bench = WorkerBench("bfloat16", model_path=str(model_dir))
    report: dict[str, Any] = {"model": f"{config.model_type} random weights, bf16"}
    for batch in (1, 32, 256):
        seconds = [bench.decode(batch, 32, f"b{batch}-{r}") for r in range(4)][1:]
        report[f"decode_b{batch}_tok_s"] = round(batch * 32 / statistics.median(seconds), 1)
    prefill = [bench.prefill(512, f"p{r}") for r in range(4)][1:]
    report["prefill_512_ms"] = round(statistics.median(prefill) * 1000, 2)
    bench.worker.shutdown()
    return report


def attention_report(timing: bool) -> dict[str, Any]:
    checks = correctness()
    return {
        "ok": all(c["ok"] for c in checks),
        "correctness_failed": [c for c in checks if not c["ok"]],
        "correctness_passed": sum(c["ok"] for c in checks),
        "correctness_worst_err": max(checks, key=lambda c: c["max_abs_err"]),
        "timings": timings() if timing else [],
    }


def summary(report: dict[str, Any]) -> str:
    """Markdown of a report: each section's verdict, then the attention and dequant timings."""
    lines = [f"# GPU check on {report['device']}\n"]
    for key, part in report.items():
        if isinstance(part, dict):
            facts = {k: v for k, v in part.items() if isinstance(v, str | int | float | bool)}
            lines.append(f"- **{key}**: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    columns = {
        "attention": ["shape", "heads", "triton_attention_ms", "triton_write_kv_ms",
                      "sdpa_dense_padded_ms"],
        "dequant_timings": ["shape", "format", "dequant_gemm_ms", "torch_bf16_ms",
                            "bf16_over_dequant"],
    }  # fmt: skip
    for key, names in columns.items():
        if report.get(key, {}).get("timings"):
            lines.append(f"\n## {key} (median ms of CUDA events)\n")
            lines.append(markdown_table(report[key]["timings"], names))
    return "\n".join(lines) + "\n"


def run_sections(sections: dict[str, Callable[[], dict[str, Any]]], out: Path | None) -> bool:
    """Run each section, writing the report after each (a device call cut short keeps what
    finished); a section that raises is recorded and the rest still run. True when all ok."""
    report: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    for key, section in sections.items():
        started = time.perf_counter()
        try:
            report[key] = section()
        except Exception:
            report[key] = {"ok": False, "error": traceback.format_exc()}
        report[key]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"gpu_check: {key} done in {report[key]['seconds']} s", file=sys.stderr, flush=True)
        if out is not None:
            out.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    if out is not None:
        out.with_suffix(".md").write_text(summary(report))
    return all(part.get("ok", True) for part in report.values() if isinstance(part, dict))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON report path")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--only-dequant", action="store_true", help="only section 3")
    parser.add_argument("--gguf", type=Path, help="the Q4_1 GGUF to serve (default model's)")
    parser.add_argument("--throughput-config", type=Path, help="model config dir: section 4")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to do", file=sys.stderr)
        return 2
    timing = not args.skip_timing
    sections: dict[str, Callable[[], dict[str, Any]]] = {}
    if not args.only_dequant:
        sections["attention"] = lambda: attention_report(timing)
    if args.throughput_config:
        sections["throughput"] = lambda: throughput(args.throughput_config)
    sections["dequant_model"] = lambda: model_check(args.gguf)
    if timing:
        sections["dequant_timings"] = lambda: timing_section(median_ms)
    sections["dequant_correctness"] = correctness_section  # the slowest (a compile a shape)
    out = args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if "OUT" in os.environ else None)
    return 0 if run_sections(sections, out) else 1


if __name__ == "__main__":
    sys.exit(main())
