"""One vLLM offline job, run by benchmarks/vllm_env.py with the python of vLLM's venv.

    python vllm_runner.py JOB.json RESULT.json

It imports only the standard library and vLLM (the project is not installed there). The
job is JSON: {"mode": "offline" | "decode", "model": DIR, "dtype": ..., ...}; the
result JSON has the timings. Prompts are token ids (vLLM's TokensPrompt), greedy, and
ignore_eos, so every request makes exactly its max_tokens.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any


def _llm(job: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(
        model=job["model"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job.get("max_model_len", 2048),
        enable_prefix_caching=job.get("prefix_caching", False),
        seed=0,
    )


def _generate(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> float:
    """Seconds to generate max_tokens[i] tokens for each token-id prompt."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    if produced != list(max_tokens):
        raise RuntimeError(f"vLLM produced {sum(produced)} tokens, expected {sum(max_tokens)}")
    return elapsed


def offline(job: dict[str, Any]) -> dict[str, Any]:
    """The workload once after a warm-up on other prompts; the clock covers generation."""
    llm = _llm(job)
    _generate(llm, job["warmup_prompts"], job["warmup_max_tokens"])
    elapsed = _generate(llm, job["prompts"], job["max_tokens"])
    return {"elapsed_s": elapsed, "output_tokens": sum(job["max_tokens"])}


def decode(job: dict[str, Any]) -> dict[str, Any]:
    """Medians over repeats, measured as HF's in decode_bench: decode time is
    t(1 + steps tokens) - t(1 token) on the same prompts (prefix caching off)."""
    llm = _llm(job)
    steps, repeats = job["steps"], job["repeats"]
    _generate(llm, job["prompts"][:1], [4])

    def decode_s(prompts: list[list[int]]) -> float:
        full = _generate(llm, prompts, [steps + 1] * len(prompts))
        return full - _generate(llm, prompts, [1] * len(prompts))

    b1 = statistics.median(decode_s(job["prompts"][:1]) for _ in range(repeats))
    bb = statistics.median(decode_s(job["prompts"]) for _ in range(repeats))
    pf = statistics.median(_generate(llm, [job["prefill_prompt"]], [1]) for _ in range(repeats))
    return {
        "decode_b1_tok_s": steps / b1,
        f"decode_b{len(job['prompts'])}_tok_s": len(job["prompts"]) * steps / bb,
        "prefill_512_s": pf,
        "prefill_512_tok_s": len(job["prefill_prompt"]) / pf,
    }


def main() -> None:
    with open(sys.argv[1]) as src:
        job = json.load(src)
    result = {"offline": offline, "decode": decode}[job["mode"]](job)
    import vllm

    result["vllm_version"] = vllm.__version__
    with open(sys.argv[2], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
