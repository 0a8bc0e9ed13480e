"""What each weight format costs in quality and buys in speed, on the default model, one run.

    python -m benchmarks.quality [--formats fp32 bf16 int8] [--steps 32] [--repeats 3]

For every format (fp32: float32; bf16: the bfloat16 default; int8: bf16 activations over
`--quantization int8` weights, Q8_0 blocks; gguf-q4_1: bf16 activations over the default
model's GGUF file as shipped, `--quantization gguf`; int4 / int4-g128: bf16 activations over
`--quantization int4` weights, Q4_1 blocks, one scale and offset per 32 / 128 weights;
NAME-kv-int8 / NAME-kv-fp8: format NAME over a quantized KV cache, `--kv-cache-dtype int8` /
`fp8_e4m3`):
- perplexity over a fixed held-in-repo text (benchmarks/data/quality_text.txt, public domain,
  ~2,000 tokens) in windows of --window tokens, from the prompt logprobs of the offline LLM;
- greedy agreement with HF transformers in float32: of 8 prompts, how many give the same
  first --new-tokens tokens, and the mean length of the common prefix;
- batch-1 and batch-32 decode tokens/s of the in-process worker (decode_bench.WorkerBench),
  formats interleaved in each repeat, medians over --repeats;
- the bytes of the weights the worker holds;
- for a quantized KV cache, perplexity over the same format's model-dtype cache (ppl_vs_kv_auto);
- llama.cpp on the same Q4_1 GGUF (llama-cpp-python in `.bench/llamacpp`, installed on first
  use; `--skip-llama-cpp` leaves it out): perplexity over the same token ids and windows, and
  batch-1 and batch-32 decode of the same prompts and steps with as many threads as Tessera.
Writes bench-results/quality.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any, Literal

import torch

from benchmarks.decode_bench import PROMPT_LEN, WorkerBench, _prompt
from benchmarks.llama_cpp_env import DEFAULT_VENV as LLAMA_CPP_VENV
from benchmarks.llama_cpp_env import LlamaCppUnavailable, run_job
from benchmarks.report import RESULTS_DIR, cpu_info, cpu_line, markdown_table, write_results
from gateway.tokenizer import Tokenizer
from services.default_model import gguf_path, resolve_model
from services.types import SamplingParams
from tessera import LLM

TEXT = Path(__file__).with_name("data") / "quality_text.txt"
Dtype = Literal["bfloat16", "float32"]
# name -> (dtype, --quantization, --kv-cache-dtype)
FORMATS: dict[str, tuple[Dtype, str, str]] = {
    "fp32": ("float32", "none", "auto"),
    "bf16": ("bfloat16", "none", "auto"),
    "int8": ("bfloat16", "int8", "auto"),
    "gguf-q4_1": ("bfloat16", "gguf", "auto"),
    "int4": ("bfloat16", "int4", "auto"),
    "int4-g128": ("bfloat16", "int4", "auto"),
    "fp32-kv-int8": ("float32", "none", "int8"),
    "bf16-kv-int8": ("bfloat16", "none", "int8"),
    "bf16-kv-fp8": ("bfloat16", "none", "fp8_e4m3"),
}
LLAMA_CPP = "llama.cpp-q4_1"  # the llama.cpp row's name
GROUPS = {"int4-g128": 128}  # --quantization-group-size of a format (else 32)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A haiku about the sea:",
    "The most important rule of writing clean code is",
    "In 1969, the first human landed on",
]
COLUMNS = ["format", "dtype", "kv_cache", "weights_mb", "perplexity", "ppl_vs_fp32",
           "ppl_vs_kv_auto", "greedy_equal", "mean_prefix", "b1_tok_s", "b32_tok_s",
           "b1_vs_bf16", "b32_vs_bf16"]  # fmt: skip


def perplexity(llm: LLM, ids: list[int], window: int) -> float:
    """exp(mean NLL) of `ids` in windows of `window` tokens (each window's first is given)."""
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    nll, count = 0.0, 0
    for chunk, out in zip(windows, llm.generate(windows, params), strict=True):
        for token, logprobs in zip(chunk[1:], (out.prompt_logprobs or [])[1:], strict=True):
            assert logprobs is not None
            nll -= logprobs[token].logprob
            count += 1
    return math.exp(nll / count)


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def hf_greedy(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF transformers' float32 greedy continuations, one prompt at a time; on the model
    thread, as Tessera's worker runs (model_thread: why)."""
    from worker_service.model_thread import model_thread

    return model_thread().call(_hf_greedy, prompts, new_tokens)


def _hf_greedy(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model("default"), dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            )  # fmt: skip
            outs.append(y[0, len(ids) :].tolist())
    return outs


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def quality(
    name: str, args: argparse.Namespace, ids: list[int], prompts: list[list[int]],
    reference: list[list[int]],
) -> dict[str, Any]:  # fmt: skip
    """Perplexity of `ids` and greedy agreement on `prompts` of one format (offline LLM)."""
    dtype, quantization, kv = FORMATS[name]
    llm = LLM(
        dtype=dtype, quantization=quantization, quantization_group_size=GROUPS.get(name, 32),
        kv_cache_dtype=kv, kv_cache_memory="256MiB", max_num_seqs=8,
    )  # fmt: skip
    try:
        outs = greedy(llm, prompts, args.new_tokens)
        prefixes = [common_prefix(o, r) for o, r in zip(outs, reference, strict=True)]
        return {
            "format": name,
            "dtype": dtype,
            "kv_cache": kv,
            "perplexity": perplexity(llm, ids, args.window),
            "greedy_equal": f"{sum(p == args.new_tokens for p in prefixes)}/{len(prefixes)}",
            "mean_prefix": statistics.mean(prefixes),
        }
    finally:
        llm.shutdown()


def weight_bytes(bench: WorkerBench) -> int:
    """Bytes of the weights the worker's model holds (int8 rows and scales included; blocks
    a tied embedding and LM head share, once)."""
    model = bench.worker.runner.model
    dense = sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values())
    quants = {id(q): q for m in model.modules() if (q := getattr(m, "quant", None)) is not None}
    return dense + sum(q.nbytes for q in quants.values())


def speed(names: list[str], steps: int, repeats: int) -> dict[str, dict[str, float]]:
    """Batch-1 and batch-32 decode tokens/s per format, interleaved, medians over repeats."""
    benches = {n: WorkerBench(*FORMATS[n], GROUPS.get(n, 32)) for n in names}
    rates: dict[str, dict[str, list[float]]] = {n: {"b1": [], "b32": []} for n in names}
    for r in range(repeats + 1):  # the first pass warms up
        for name, bench in benches.items():
            for batch in (1, 32):
                seconds = bench.decode(batch, steps, f"{name}-{batch}-{r}")
                if r:
                    rates[name][f"b{batch}"].append(batch * steps / seconds)
    out = {}
    for name, bench in benches.items():
        out[name] = {f"{k}_tok_s": statistics.median(v) for k, v in rates[name].items()}
        out[name]["weights_mb"] = weight_bytes(bench) / 2**20
    return out


def llama_cpp(args: argparse.Namespace, ids: list[int]) -> tuple[dict[str, Any], str | None]:
    """llama.cpp's perplexity and decode speed on the default GGUF, as a (quality, speed) row
    pair under "llama.cpp-q4_1"; or the reason it could not run."""
    job = {
        "model": str(gguf_path()), "threads": torch.get_num_threads(),
        "prompts": [_prompt(i, PROMPT_LEN) for i in range(32)], "batches": [1, 32],
        "steps": args.steps, "repeats": args.repeats, "text_ids": ids, "window": args.window,
    }  # fmt: skip
    try:
        result = run_job(job, args.llama_cpp_venv)
    except LlamaCppUnavailable as exc:
        print(f"llama.cpp: {exc}", flush=True)
        return {}, str(exc)
    row = {
        "format": LLAMA_CPP, "dtype": f"llama.cpp {result['llama_cpp_version']}",
        "kv_cache": "f16", "perplexity": result["perplexity"], "greedy_equal": "-",
        "mean_prefix": "-", "b1_tok_s": result["b1_tok_s"], "b32_tok_s": result["b32_tok_s"],
        "weights_mb": gguf_path().stat().st_size / 2**20,
    }  # fmt: skip
    return row, None


def rows(
    results: list[dict[str, Any]], speeds: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """Quality and speed per format, with ratios to fp32 perplexity and to bf16 speed, and
    a quantized KV cache's perplexity over its format's model-dtype cache (NAME-kv-*: NAME)."""
    by_name = {r["format"]: {**r, **speeds.get(r["format"], {})} for r in results}
    fp32, bf16 = by_name.get("fp32"), by_name.get("bf16")
    for name, row in by_name.items():
        row["ppl_vs_fp32"] = row["perplexity"] / fp32["perplexity"] if fp32 else None
        auto = by_name.get(name.split("-kv-")[0]) if "-kv-" in name else None
        row["ppl_vs_kv_auto"] = row["perplexity"] / auto["perplexity"] if auto else None
        for b in ("b1", "b32"):
            row[f"{b}_vs_bf16"] = row[f"{b}_tok_s"] / bf16[f"{b}_tok_s"] if bf16 else None
    return list(by_name.values())


def table(data: dict[str, Any]) -> str:
    head = (
        "### Weight formats: quality and decode speed (default model)\n\n"
        f"{cpu_line(data['cpu'])}; perplexity over {data['text_tokens']} tokens of "
        f"`{TEXT.name}` in {data['window']}-token windows; greedy vs HF float32 on "
        f"{len(PROMPTS)} prompts x {data['new_tokens']} tokens; decode medians of "
        f"{data['repeats']} repeats of {data['steps']} steps. {LLAMA_CPP}: llama.cpp itself "
        f"on the GGUF Tessera serves as gguf-q4_1, same prompts, steps and threads"
        + (f" (not run: {data['llama_cpp_error']})" if data.get("llama_cpp_error") else "")
        + ".\n\n"
    )
    return head + markdown_table(data["rows"], COLUMNS)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared with HF")
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3, help="decode repeats; figures are medians")
    p.add_argument("--name", default="quality", help="result file name")
    p.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp row")
    p.add_argument("--llama-cpp-venv", type=Path, default=LLAMA_CPP_VENV)
    args = p.parse_args(argv)
    tokenizer = Tokenizer.load(resolve_model("default"))
    ids = tokenizer.encode(TEXT.read_text(), False)
    prompts = [tokenizer.encode(t, False) for t in PROMPTS]
    reference = hf_greedy(prompts, args.new_tokens)
    results = [quality(name, args, ids, prompts, reference) for name in args.formats]
    speeds = speed(args.formats, args.steps, args.repeats)
    llama_row, llama_error = llama_cpp(args, ids) if not args.skip_llama_cpp else ({}, "skipped")
    data = {
        "cpu": cpu_info(), "window": args.window, "new_tokens": args.new_tokens,
        "steps": args.steps, "repeats": args.repeats, "text_tokens": len(ids),
        "rows": rows(results + ([llama_row] if llama_row else []), speeds),
        "llama_cpp_error": llama_error,
    }  # fmt: skip
    text = table(data)
    write_results(args.name, data, text, RESULTS_DIR)
    print(text)
    return data


if __name__ == "__main__":
    main()
