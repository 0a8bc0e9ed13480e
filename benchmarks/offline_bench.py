"""Offline throughput, like `vllm bench throughput`: the "mixed" workload through the
offline LLM API, and on the same workload in the same run HF transformers static batching
and vLLM's CPU build (`LLM.generate` on the same token-id prompts, in its own venv).

    python -m benchmarks.offline_bench [--skip-hf] [--skip-vllm] [--num-requests 64]

vLLM runs in bf16 (`--dtype`) from `--vllm-venv` (created with vLLM on first use); if it
cannot be installed or run, the results say why and keep the other engines' figures.

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

from benchmarks.report import (
    RESULTS_DIR,
    bar_plot,
    cpu_info,
    cpu_line,
    markdown_table,
    ratio,
    write_results,
)
from benchmarks.vllm_env import DEFAULT_VENV, VllmEnv, VllmUnavailable, run_job
from benchmarks.workload import BenchRequest, mixed_workload
from services.types import SamplingParams

WARMUP_SEED = 99  # the warm-up's prompts: other prompts, so nothing of the run gets cached


def run_tessera(requests: list[BenchRequest], dtype: str, kv_cache_memory: str) -> dict[str, Any]:
    """The workload through tessera.LLM; the clock covers generation only (not loading)."""
    from tessera import LLM

    llm = LLM(dtype=dtype, kv_cache_memory=kv_cache_memory)
    try:
        params = [
            SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            for r in requests
        ]
        warmup = mixed_workload(2, seed=WARMUP_SEED)
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
    """HF static batching: batches in order, left padding, each batch runs to its longest
    output; on the model thread, as Tessera's worker runs (model_thread: why)."""
    from worker_service.model_thread import model_thread

    return model_thread().call(_run_hf, requests, dtype, batch_size)


def _run_hf(requests: list[BenchRequest], dtype: str, batch_size: int) -> dict[str, Any]:
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


def run_vllm(requests: list[BenchRequest], dtype: str, env: VllmEnv) -> dict[str, Any]:
    """The workload through vLLM's offline LLM.generate in its venv (generation timed only)."""
    from services.default_model import resolve_model

    warmup = mixed_workload(2, seed=WARMUP_SEED)
    job = {
        "mode": "offline",
        "model": str(resolve_model("default")),
        "dtype": dtype,
        "prefix_caching": True,  # vLLM's default, as Tessera's LLM keeps its prefix cache on
        "prompts": [r.prompt_token_ids for r in requests],
        "max_tokens": [r.output_len for r in requests],
        "warmup_prompts": [r.prompt_token_ids for r in warmup],
        "warmup_max_tokens": [r.output_len for r in requests[:2]],
    }
    result = run_job(env, job)
    return {**_figures("vllm", requests, result["elapsed_s"]), "version": result["vllm_version"]}


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


def compare(rows: list[dict[str, Any]], vllm_error: str | None) -> dict[str, Any]:
    """Tessera's speed-ups (>1: Tessera faster) over each other engine present in rows."""
    by_engine = {r["engine"]: r["elapsed_s"] for r in rows}
    ours = by_engine["tessera"]
    out: dict[str, Any] = {
        f"tessera_vs_{name}": ratio(ours, theirs, lower_is_better=True)
        for name, theirs in by_engine.items()
        if name != "tessera"
    }
    if vllm_error is not None:
        out["vllm_error"] = vllm_error
    return out


def table(data: dict[str, Any]) -> str:
    """The Markdown of one offline run: the CPU, one row per engine, Tessera's ratios."""
    columns = ["engine", "elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s"]
    text = f"### Offline throughput (mixed, {data['num_requests']} requests, Tessera and vLLM "
    text += f"{data['dtype']}, HF {data['hf_dtype']})\n\n{cpu_line(data['cpu'])}\n\n"
    text += markdown_table(data["results"], columns)
    names = {"hf-static": "HF static batching", "vllm": "vLLM"}
    for key, value in data["ratios"].items():
        other = key.removeprefix("tessera_vs_")
        if key.startswith("tessera_vs_") and value is not None:
            text += f"\nTessera / {names.get(other, other)}: **{value:.2f}x**\n"
    if "vllm_error" in data["ratios"]:
        text += f"\nvLLM: not measured ({data['ratios']['vllm_error']})\n"
    return text


def plot(data: dict[str, Any], path: Path) -> None:
    rows = data["results"]
    title = f"Offline output tokens/s (mixed)\n{cpu_line(data['cpu'])}"
    labels = [r["engine"] for r in rows]
    bar_plot(path, title, labels, [r["output_tokens_per_s"] for r in rows], "output tokens/s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--skip-hf", action="store_true", help="leave HF out")
    p.add_argument("--skip-vllm", action="store_true", help="leave vLLM out")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="vLLM's virtualenv")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--no-vllm-install", action="store_true", help="report vLLM unavailable if not installed"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    requests = mixed_workload(args.num_requests, seed=args.seed)
    rows = [run_tessera(requests, args.dtype, args.kv_cache_memory)]
    hf_dtype = hf_dtype_for(args.dtype, args.hf_dtype)
    if not args.skip_hf:
        rows.append(run_hf(requests, hf_dtype, args.hf_batch_size))
    vllm_error = None
    if not args.skip_vllm:
        try:
            env = VllmEnv(args.vllm_venv, args.vllm_kv_cache_gib, not args.no_vllm_install)
            rows.append(run_vllm(requests, args.dtype, env))
        except VllmUnavailable as exc:
            vllm_error = str(exc)
            print(f"vLLM: {vllm_error}", flush=True)
    data = {
        "workload": "mixed",
        "num_requests": len(requests),
        "dtype": args.dtype,
        "hf_dtype": hf_dtype,
        "cpu": cpu_info(),
        "results": rows,
        "ratios": compare(rows, vllm_error),
    }
    text = table(data)
    write_results("offline", data, text, args.out_dir)
    plot(data, args.out_dir / "offline.png")
    print(text)
    return data


if __name__ == "__main__":
    main()
