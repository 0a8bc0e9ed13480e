"""Worker decode/prefill throughput vs HF transformers and vLLM, same machine, same run.

    python -m benchmarks.decode_bench [--dtype bfloat16] [--steps 32] [--repeats 3] [--profile]

Measures (medians over repeats): batch-1 decode tokens/s, batch-32 decode tokens/s and a
512-token prefill, for the in-process Worker (no gRPC), for it again with --deterministic
(batch-invariant kernels; its repeats interleaved with the default's, so that both see the same
machine load; `--skip-deterministic` leaves it out), for HF transformers (eager
generate with a KV cache; a static batch of 32 equal-length prompts) and for vLLM's
offline LLM.generate (same prompts, prefix caching off; its venv: `--vllm-venv`), all in
`--dtype`. Decode time excludes the prefill: HF's and vLLM's is
t(generate 1 + N tokens) - t(generate 1 token); vLLM's prefill is t(generate 1 token).
Writes bench-results/decode.json, .md and .png and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import torch

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
from services.config import DEFAULT_MODEL, CacheConfig, ModelConfig, WorkerConfig
from services.default_model import resolve_model
from services.step_types import CachedRequestData, NewRequestData, SchedulerOutput
from services.types import SamplingParams
from worker_service.model_thread import model_thread, on_model_thread
from worker_service.worker import Worker, configure_threads

GREEDY = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
PROMPT_LEN = 16
BLOCK = 16


def _prompt(i: int, n: int) -> list[int]:
    return [(1000 + 37 * i + 11 * j) % 40000 + 100 for j in range(n)]


class WorkerBench:
    """Drives a Worker directly with hand-built SchedulerOutputs."""

    def __init__(
        self,
        dtype: Literal["bfloat16", "float32"],
        quantization: str = "none",
        kv_cache_dtype: str = "auto",
        group: int = 32,
        deterministic: bool = False,
        model_path: str | None = None,
    ) -> None:
        model = ModelConfig(
            model=model_path or DEFAULT_MODEL,
            dtype=dtype,
            quantization=quantization,
            quantization_group_size=group,
            deterministic=deterministic,
        )
        self.worker = Worker(
            WorkerConfig(model=model, cache=CacheConfig(cache_dtype=kv_cache_dtype))
        )
        self.worker.initialize_cache(1024)
        self.step = 0

    def _run(self, so: SchedulerOutput) -> None:
        self.step += 1
        so.step_id = self.step
        self.worker.execute_model(so)

    def decode(self, batch: int, steps: int, tag: str) -> float:
        """Seconds for `steps` decode steps of `batch` requests (prefill not timed)."""
        blocks_each = -(-(PROMPT_LEN + steps + 1) // BLOCK)
        ids = [f"{tag}-{i}" for i in range(batch)]
        news = [
            NewRequestData(
                r,
                _prompt(i, PROMPT_LEN),
                [],
                GREEDY,
                list(range(i * blocks_each, (i + 1) * blocks_each)),
            )
            for i, r in enumerate(ids)
        ]
        self._run(
            SchedulerOutput(
                0, news, CachedRequestData(), dict.fromkeys(ids, PROMPT_LEN), batch * PROMPT_LEN
            )
        )
        start = time.perf_counter()
        for k in range(steps):
            cached = CachedRequestData.of((r, PROMPT_LEN + k, []) for r in ids)
            self._run(SchedulerOutput(0, [], cached, dict.fromkeys(ids, 1), batch))
        elapsed = time.perf_counter() - start
        self._run(SchedulerOutput(0, finished_req_ids=ids))
        return elapsed

    def prefill(self, n: int, tag: str) -> float:
        new = NewRequestData(tag, _prompt(0, n), [], GREEDY, list(range(-(-n // BLOCK) + 1)))
        start = time.perf_counter()
        self._run(SchedulerOutput(0, [new], CachedRequestData(), {tag: n}, n))
        elapsed = time.perf_counter() - start
        self._run(SchedulerOutput(0, finished_req_ids=[tag]))
        return elapsed


class HFBench:
    """HF transformers eager generate (sdpa attention, dynamic KV cache), on the model thread
    as Tessera's worker runs (model_thread: why)."""

    def __init__(self, dtype: str) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.thread = model_thread()
        self.model = self.thread.call(
            AutoModelForCausalLM.from_pretrained,
            resolve_model("default"),
            dtype=getattr(torch, dtype),
        ).eval()
        self.config = GenerationConfig

    @on_model_thread
    def _generate(self, batch: int, new_tokens: int) -> float:
        ids = torch.tensor([_prompt(i, PROMPT_LEN) for i in range(batch)])
        cfg = self.config(
            do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0
        )
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        return time.perf_counter() - start

    def decode(self, batch: int, steps: int, tag: str) -> float:
        return self._generate(batch, steps + 1) - self._generate(batch, 1)

    @on_model_thread
    def prefill(self, n: int, tag: str) -> float:
        ids = torch.tensor([_prompt(0, n)])
        start = time.perf_counter()
        with torch.inference_mode():
            self.model(ids)
        return time.perf_counter() - start


def measure_vllm(env: VllmEnv, dtype: str, steps: int, repeats: int, batch: int) -> dict[str, Any]:
    """The same figures for vLLM, from one offline run in its venv."""
    job = {
        "mode": "decode",
        "model": str(resolve_model("default")),
        "dtype": dtype,
        "prompts": [_prompt(i, PROMPT_LEN) for i in range(batch)],
        "prefill_prompt": _prompt(0, 512),
        "steps": steps,
        "repeats": repeats,
    }
    result = run_job(env, job)
    return {k: v for k, v in result.items() if k != "vllm_version"}


def measure(bench: Any, steps: int, repeats: int, batch: int) -> dict[str, float]:
    return measure_interleaved([bench], steps, repeats, batch)[0]


def measure_interleaved(
    benches: list[Any], steps: int, repeats: int, batch: int
) -> list[dict[str, float]]:
    """`measure`'s figures for each bench, every repeat of a metric run by each bench in turn
    (the same load for all on a shared, noisy machine)."""
    for bench in benches:
        bench.decode(1, 4, "warm")

    def times(run: Any) -> list[list[float]]:  # [bench][repeat] seconds
        rounds = [[run(b, r) for b in benches] for r in range(repeats)]
        return [list(col) for col in zip(*rounds, strict=True)]

    b1 = times(lambda b, r: b.decode(1, steps, f"b1-{r}"))
    bb = times(lambda b, r: b.decode(batch, steps, f"bb-{r}"))
    pf = times(lambda b, r: b.prefill(512, f"pf-{r}"))
    return [
        {
            "decode_b1_tok_s": steps / statistics.median(b1[i]),
            f"decode_b{batch}_tok_s": batch * steps / statistics.median(bb[i]),
            "prefill_512_s": statistics.median(pf[i]),
            "prefill_512_tok_s": 512 / statistics.median(pf[i]),
        }
        for i in range(len(benches))
    ]


def profile_decode(bench: WorkerBench, steps: int) -> str:
    from torch.profiler import profile

    with profile() as prof:
        bench.decode(1, steps, "prof")
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-deterministic", action="store_true", help="no --deterministic run")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="vLLM's virtualenv")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--no-vllm-install", action="store_true", help="report vLLM unavailable if not installed"
    )
    p.add_argument("--profile", action="store_true", help="print a torch profile of batch-1 decode")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    threads = configure_threads(args.num_threads)
    ours_bench = WorkerBench(args.dtype)
    benches = [ours_bench]
    if not args.skip_deterministic:
        benches.append(WorkerBench(args.dtype, deterministic=True))
    figures = measure_interleaved(benches, args.steps, args.repeats, args.batch)
    results: dict[str, Any] = {
        "dtype": args.dtype,
        "threads": threads,
        "steps": args.steps,
        "repeats": args.repeats,
        "batch": args.batch,
        "cpu": cpu_info(),
        "tessera": figures[0],
    }
    if len(figures) > 1:
        results["tessera_deterministic"] = figures[1]
    if args.profile:
        print(profile_decode(ours_bench, args.steps))
    del ours_bench, benches
    if not args.skip_hf:
        results["hf_transformers"] = measure(
            HFBench(args.dtype), args.steps, args.repeats, args.batch
        )
    if not args.skip_vllm:
        try:
            env = VllmEnv(args.vllm_venv, args.vllm_kv_cache_gib, not args.no_vllm_install)
            results["vllm"] = measure_vllm(env, args.dtype, args.steps, args.repeats, args.batch)
        except VllmUnavailable as exc:
            results["vllm_error"] = str(exc)
            print(f"vLLM: {exc}", flush=True)
    text = table(results)
    write_results("decode", results, text, args.out_dir)
    plot(results, args.out_dir / "decode.png")
    print(text)
    return results


ENGINES = {"tessera": "tessera", "hf_transformers": "hf", "vllm": "vllm"}  # results key: label


def table(results: dict[str, Any]) -> str:
    """Markdown: each metric for Tessera, HF and vLLM with Tessera's ratios (>1: Tessera ahead)."""
    rows = []
    for key, ours in results["tessera"].items():
        row: dict[str, Any] = {"metric": key, "tessera": ours}
        for engine, label in list(ENGINES.items())[1:]:
            theirs = results.get(engine, {}).get(key)
            row[label] = "" if theirs is None else theirs
            mine = ratio(ours, theirs, lower_is_better=key == "prefill_512_s")
            row[f"tessera / {label}"] = "" if mine is None else mine
        rows.append(row)
    title = (
        f"### Decode and prefill ({results['dtype']}, {results['threads']} threads, "
        f"medians of {results['repeats']})\n\n{cpu_line(results['cpu'])}\n\n"
    )
    columns = ["metric", "tessera", "hf", "vllm", "tessera / hf", "tessera / vllm"]
    text = title + markdown_table(rows, columns)
    if "vllm_error" in results:
        text += f"\nvLLM: not measured ({results['vllm_error']})\n"
    return text + deterministic_table(results)


def deterministic_table(results: dict[str, Any]) -> str:
    """Markdown: --deterministic's figures against the default's (same run, interleaved)."""
    det = results.get("tessera_deterministic")
    if det is None:
        return ""
    rows = []
    for key, ours in results["tessera"].items():
        cost = ratio(det[key], ours, lower_is_better=key == "prefill_512_s")
        rows.append({"metric": key, "default": ours, "deterministic": det[key],
                     "deterministic speed / default": "" if cost is None else cost})  # fmt: skip
    columns = ["metric", "default", "deterministic", "deterministic speed / default"]
    title = "\n### --deterministic (batch-invariant kernels), interleaved with the default\n\n"
    return title + markdown_table(rows, columns)


def plot(results: dict[str, Any], path: Path) -> None:
    """Decode tokens/s at batch 1 and the large batch, one bar per engine measured."""
    batch = results["batch"]
    bars = [(f"{label} b{b}", results[engine][f"decode_b{b}_tok_s"])
            for b in (1, batch) for engine, label in ENGINES.items() if engine in results]  # fmt: skip
    title = f"Decode tokens/s ({results['dtype']}, {results['threads']} threads)\n"
    title += cpu_line(results["cpu"])
    bar_plot(path, title, [b[0] for b in bars], [b[1] for b in bars], "tokens/s")


if __name__ == "__main__":
    main()
