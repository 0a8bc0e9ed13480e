"""Multi-LoRA throughput: the "mixed" workload through the offline LLM API on the default
model, base-only and with 4 adapters mixed (request i runs adapter i % 4), in one run, on
one engine started with --enable-lora --max-loras 4; plus base-only on an engine without
LoRA (the feature-off path). Target (issue 23): mixed >= 70% of base-only.

    python -m benchmarks.lora_bench [--num-requests 16] [--repeats 3] [--ranks 8 12 16 16]

The adapters are random (ranks --ranks, every q/k/v/o/gate/up/down projection), written
in PEFT's layout to a temporary directory at bench time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS_DIR, cpu_info, cpu_line, markdown_table, write_results
from benchmarks.workload import BenchRequest, mixed_workload
from services.types import LoRARequest, SamplingParams

TARGET = 0.70  # mixed adapters / base-only, issue 23's acceptance
WARMUP_SEED = 99


def write_random_adapter(model_dir: Path, out_dir: Path, rank: int, seed: int) -> Path:
    """A PEFT-layout LoRA adapter over `model_dir` with random A and B (scale ~ a trained one's)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {  # projection: (in, out)
        "self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [p.split(".")[1] for p in shapes],
    }  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


def timed_generate(llm: Any, requests: list[BenchRequest], loras: list[Any]) -> float:
    """Seconds `llm.generate` takes for `requests` (each with its adapter or None)."""
    params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(
        [r.prompt_token_ids for r in requests], params, use_tqdm=False, lora_request=loras
    )
    elapsed = time.perf_counter() - start
    assert all(not o.outputs[0].error for o in outputs), outputs[0].outputs[0].error
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == sum(r.output_len for r in requests)
    return elapsed


def row(name: str, requests: list[BenchRequest], times: list[float]) -> dict[str, Any]:
    """One run's figures from its repeats: the median time, and throughput at the median."""
    elapsed = statistics.median(times)
    return {
        "run": name,
        "elapsed_s": elapsed,
        "elapsed_all_s": times,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": sum(r.output_len for r in requests) / elapsed,
    }


RUNS = ("lora-off, base only", "lora-on, base only", "lora-on, adapters mixed")


def run(
    requests: list[BenchRequest], ranks: list[int], dtype: str, kv: str, repeats: int
) -> list[dict[str, Any]]:
    """The three runs (see the module doc), interleaved `repeats` times so that load on the
    machine touches each alike; prefix caching off, so every repeat computes everything."""
    from services.default_model import resolve_model
    from tessera import LLM

    model_dir = resolve_model("default")
    warmup = mixed_workload(len(ranks), seed=WARMUP_SEED, output_len=(4, 8))
    with tempfile.TemporaryDirectory(prefix="tessera-lora-bench-") as tmp:
        adapters = [
            LoRARequest(f"bench{i}", i + 1, str(write_random_adapter(model_dir, Path(tmp) / f"a{i}", r, i)))
            for i, r in enumerate(ranks)
        ]  # fmt: skip
        off = LLM(dtype=dtype, kv_cache_memory=kv, enable_prefix_caching=False)
        on = LLM(dtype=dtype, kv_cache_memory=kv, enable_prefix_caching=False, enable_lora=True,
                 max_loras=len(ranks), max_lora_rank=max(ranks))  # fmt: skip
        base: list[LoRARequest | None] = [None] * len(requests)
        mixed: list[LoRARequest | None] = [
            adapters[i % len(adapters)] for i in range(len(requests))
        ]
        plan: list[tuple[Any, list[LoRARequest | None]]] = [(off, base), (on, base), (on, mixed)]
        times: list[list[float]] = [[] for _ in plan]
        try:
            timed_generate(off, warmup, [None] * len(warmup))
            timed_generate(on, warmup, adapters)  # loads every adapter, warms the kernels
            for _ in range(repeats):
                for i, (llm, loras) in enumerate(plan):
                    times[i].append(timed_generate(llm, requests, loras))
        finally:
            off.shutdown()
            on.shutdown()
    return [row(name, requests, t) for name, t in zip(RUNS, times, strict=True)]


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Adapters mixed / base only on the LoRA engine, and its base only / LoRA off."""
    tps = {r["run"]: r["output_tokens_per_s"] for r in rows}
    return {
        "mixed_vs_base": tps[RUNS[2]] / tps[RUNS[1]],
        "lora_on_base_vs_lora_off": tps[RUNS[1]] / tps[RUNS[0]],
    }


def table(data: dict[str, Any]) -> str:
    text = f"### Multi-LoRA throughput (mixed workload, {data['num_requests']} requests, "
    text += f"{data['dtype']}, {len(data['ranks'])} adapters of ranks {data['ranks']}, "
    text += f"median of {data['repeats']})\n\n{cpu_line(data['cpu'])}\n\n"
    text += markdown_table(
        data["results"], ["run", "elapsed_s", "requests_per_s", "output_tokens_per_s"]
    )
    r = data["ratios"]
    verdict = "meets" if r["mixed_vs_base"] >= TARGET else "misses"
    text += f"\nAdapters mixed / base only: **{r['mixed_vs_base']:.2f}x** ({verdict} the "
    text += f"{TARGET:.0%} target); LoRA engine base only / LoRA off: "
    text += f"**{r['lora_on_base_vs_lora_off']:.2f}x**\n"
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median)")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 12, 16, 16])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    requests = mixed_workload(args.num_requests, seed=args.seed, output_len=tuple(args.output_len))
    rows = run(requests, args.ranks, args.dtype, args.kv_cache_memory, args.repeats)
    data = {
        "workload": "mixed",
        "num_requests": len(requests),
        "dtype": args.dtype,
        "ranks": args.ranks,
        "repeats": args.repeats,
        "cpu": cpu_info(),
        "results": rows,
        "ratios": ratios(rows),
    }
    text = table(data)
    write_results("lora", data, text, args.out_dir)
    print(text)
    return data


if __name__ == "__main__":
    main()
