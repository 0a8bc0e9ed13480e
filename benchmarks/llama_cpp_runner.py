"""One llama.cpp job, run by benchmarks/llama_cpp_env.py with the python of its venv.

    python llama_cpp_runner.py JOB.json RESULT.json

It imports only the standard library, numpy and llama-cpp-python (the project is not
installed there) and drives llama.cpp through its C API as the decode benchmark drives
Tessera's worker: `batch` sequences of token-id prompts prefilled (not timed), then `steps`
decode steps of one token per sequence, medians over `repeats`; and the perplexity of
`text_ids` in windows of `window` tokens (each window's first token given). The job is JSON:
{"model": FILE.gguf, "threads": N, "prompts": [[ids]], "batches": [1, 32], "steps": S,
"repeats": R, "text_ids": [...], "window": W}.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import statistics
import sys
import time
from typing import Any

import numpy as np


class Context:
    """A llama.cpp context over `model` holding up to `seqs` sequences of `ctx` tokens each."""

    def __init__(self, lib: Any, model: Any, threads: int, seqs: int, ctx: int) -> None:
        self.lib = L = lib
        params = L.llama_context_default_params()
        params.n_ctx = seqs * ctx
        params.n_batch = params.n_ubatch = max(512, seqs)
        params.n_seq_max = seqs
        params.n_threads = params.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = L.llama_batch_init(max(512, seqs), 0, seqs)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def decode(self, tokens: list[tuple[int, int, int]], logits: bool = False) -> None:
        """One llama_decode of (token, position, sequence) triples; logits of the last only,
        or of all where `logits`."""
        b = self.batch
        for i, (token, pos, seq) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits or i == len(tokens) - 1
        b.n_tokens = len(tokens)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def logits(self, i: int) -> np.ndarray:
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                     shape=(self.n_vocab,)).astype(np.float64)  # fmt: skip

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def decode_seconds(ctx: Context, prompts: list[list[int]], steps: int) -> float:
    """Prefill each prompt as its own sequence, then time `steps` one-token-each steps."""
    ctx.clear()
    for seq, prompt in enumerate(prompts):
        ctx.decode([(t, pos, seq) for pos, t in enumerate(prompt)])
    start = time.perf_counter()
    for k in range(steps):
        ctx.decode([(p[-1], len(p) + k, seq) for seq, p in enumerate(prompts)])
    return time.perf_counter() - start


def perplexity(ctx: Context, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        ctx.clear()
        ctx.decode([(t, pos, 0) for pos, t in enumerate(chunk)], logits=True)
        for i, token in enumerate(chunk[1:]):
            x = ctx.logits(i)
            top = x.max()
            nll += top + np.log(np.exp(x - top).sum()) - x[token]
            count += 1
    return float(np.exp(nll / count))


def run(job: dict[str, Any]) -> dict[str, Any]:
    L = importlib.import_module("llama_cpp")  # only in llama.cpp's venv, not the project's
    L.llama_backend_init()
    model = L.llama_model_load_from_file(job["model"].encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {job['model']}")
    result: dict[str, Any] = {"llama_cpp_version": L.__version__}
    longest = max(len(p) for p in job["prompts"]) + job["steps"] + 8
    for batch in job["batches"]:
        ctx = Context(L, model, job["threads"], batch, longest)
        prompts = job["prompts"][:batch]
        decode_seconds(ctx, prompts, job["steps"])  # warm-up
        times = [decode_seconds(ctx, prompts, job["steps"]) for _ in range(job["repeats"])]
        result[f"b{batch}_tok_s"] = batch * job["steps"] / statistics.median(times)
        ctx.close()
    if job.get("text_ids"):
        ctx = Context(L, model, job["threads"], 1, job["window"] + 8)
        result["perplexity"] = perplexity(ctx, job["text_ids"], job["window"])
        ctx.close()
    L.llama_model_free(model)
    return result


if __name__ == "__main__":
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    with open(result_path, "w") as f:
        json.dump(run(job), f)
