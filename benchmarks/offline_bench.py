"""Offline throughput, like `vllm bench throughput`: the "mixed" workload through the
offline LLM API, and HF transformers static batching on the same workload in the same run.

    python -m benchmarks.offline_bench [--skip-hf] [--num-requests 64] [--hf-dtype auto]

HF runs in `--hf-dtype`; "auto" is Tessera's dtype, except bfloat16 on a CPU without
bf16 instructions, where HF gets float32: its bf16 GEMMs are emulated there and run
several times slower than its float32 ones (a 512-token bf16 prefill takes ~6x longer),
so float32 is HF's fastest setting and the fair comparison.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS_DIR, bar_plot, markdown_table, write_results
from benchmarks.workload import BenchRequest, mixed_workload
from services.types import SamplingParams


def run_tessera(requests: list[BenchRequest], dtype: str, kv_cache_memory: str) -> dict[str, Any]:
    """The workload through tessera.LLM; the clock covers generation only (not loading)."""
    from tessera import LLM

    llm = LLM(dtype=dtype, kv_cache_memory=kv_cache_memory)
    try:
        params = [
            SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            for r in requests
        ]
        warmup = mixed_workload(2, seed=99)  # other prompts: nothing of the run gets cached
        llm.generate([r.prompt_token_ids for r in warmup], params[:2], use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(r.output_len for r in requests), "tessera produced the wrong token count"
    return _figures("tessera", requests, elapsed)


def run_hf(requests: list[BenchRequest], dtype: str, batch_size: int) -> dict[str, Any]:
    """HF static batching: batches in order, left padding, each batch runs to its longest output."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.default_model import resolve_model

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model("default"), dtype=getattr(torch, dtype)
    )
    model.generation_config.pad_token_id = 2
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        _hf_batch(model, requests[i : i + batch_size])
    return _figures("hf-static", requests, time.perf_counter() - start)


def _hf_batch(model: Any, batch: list[BenchRequest]) -> None:
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), 2, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids) :] = 1
    longest = max(r.output_len for r in batch)
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
        )


def hf_dtype_for(dtype: str, choice: str) -> str:
    """HF's dtype: `choice`, or for "auto" Tessera's unless that is bf16 on a CPU without bf16."""
    from worker_service.cpu_kernels import read_cpu_info

    if choice != "auto":
        return choice
    return "float32" if dtype == "bfloat16" and not read_cpu_info().native_bf16 else dtype


def _figures(name: str, requests: list[BenchRequest], elapsed: float) -> dict[str, Any]:
    out_tokens = sum(r.output_len for r in requests)
    in_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return {
        "engine": name,
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--skip-hf", action="store_true", help="measure Tessera only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    requests = mixed_workload(args.num_requests, seed=args.seed)
    rows = [run_tessera(requests, args.dtype, args.kv_cache_memory)]
    hf_dtype = hf_dtype_for(args.dtype, args.hf_dtype)
    if not args.skip_hf:
        rows.append(run_hf(requests, hf_dtype, args.hf_batch_size))
        rows[0]["speedup_vs_hf"] = rows[1]["elapsed_s"] / rows[0]["elapsed_s"]
    data = {
        "workload": "mixed",
        "num_requests": len(requests),
        "dtype": args.dtype,
        "hf_dtype": hf_dtype,
        "results": rows,
    }
    columns = ["engine", "elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s"]
    table = f"### Offline throughput (mixed, {len(requests)} requests, Tessera {args.dtype}"
    table += f", HF {hf_dtype})\n\n"
    table += markdown_table(rows, columns)
    if "speedup_vs_hf" in rows[0]:
        table += f"\nTessera / HF static batching: **{rows[0]['speedup_vs_hf']:.2f}x**\n"
    write_results("offline", data, table, args.out_dir)
    bar_plot(args.out_dir / "offline.png", "Offline output tokens/s (mixed)", [r["engine"] for r in rows],
             [r["output_tokens_per_s"] for r in rows], "output tokens/s")  # fmt: skip
    print(table)
    return data


if __name__ == "__main__":
    main()
