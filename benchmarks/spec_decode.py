"""Speculative decoding (ngram prompt lookup) against plain decoding, batch 1, one run.

    python -m benchmarks.spec_decode [--dtype bfloat16] [--max-tokens 128] [--repeats 3]

Two offline engines on the default model, one with `--speculative-config` ngram, serve the
same requests one at a time, interleaved: the repetitive workload (benchmarks.spec_workload:
copy / edit / quote a given text) and W1 (the "mixed" random-token workload of the offline
bench, its first --w1-requests requests, outputs capped at --max-tokens). Decode tokens/s is
(output tokens - 1) / (time from first to last token), summed over a workload's requests;
figures are medians over --repeats. Mean accepted length is vLLM's: 1 + accepted / drafts
(tokens a verifying step yields). Writes bench-results/spec_decode.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.report import RESULTS_DIR, cpu_info, cpu_line, markdown_table, write_results
from benchmarks.spec_workload import repetitive_chats
from benchmarks.workload import mixed_workload
from services.types import EngineCoreRequest, SamplingParams
from tessera import LLM

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
COLUMNS = ["workload", "plain_tok_s", "spec_tok_s", "speedup", "mean_accepted_len",
           "acceptance_rate", "target"]  # fmt: skip
TARGETS = {"repetitive": 1.5, "W1": 0.95}  # speedup asked for by issue 23


@dataclass
class Totals:
    """Decode tokens and seconds of one engine over one pass of a workload."""

    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def decode_one(llm: LLM, prompt_ids: list[int], max_tokens: int, tag: str) -> tuple[int, float]:
    """Run one request alone; (decode tokens after the first, seconds first -> last token)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(EngineCoreRequest(tag, prompt_ids, params, arrival_time=time.time()))
    first, count = 0.0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and not count:
                first = time.perf_counter()
            count += len(out.new_token_ids)
    return count - 1, time.perf_counter() - first


def run_pass(
    engines: dict[str, LLM], prompts: list[tuple[list[int], int]], tag: str
) -> dict[str, Totals]:
    """Every prompt through every engine, interleaved (so drift hits both alike)."""
    totals = {name: Totals() for name in engines}
    for i, (ids, max_tokens) in enumerate(prompts):
        for name, llm in engines.items():
            tokens, seconds = decode_one(llm, ids, max_tokens, f"{tag}-{i}-{name}")
            totals[name].tokens += tokens
            totals[name].seconds += seconds
    return totals


def workloads(
    llm: LLM, max_tokens: int, w1_requests: int
) -> dict[str, list[tuple[list[int], int]]]:
    """Token ids and output length of each request, per workload."""
    tok = llm.tokenizer
    repetitive = [(tok.encode(tok.render_chat(c), False), max_tokens) for c in repetitive_chats()]
    w1 = [(r.prompt_token_ids, min(r.output_len, max_tokens)) for r in mixed_workload()]
    return {"repetitive": repetitive, "W1": w1[:w1_requests]}


def measure(
    engines: dict[str, LLM], prompts: list[tuple[list[int], int]], name: str, repeats: int
) -> dict[str, Any]:
    """Median rates over repeats, and the speculative engine's acceptance figures."""
    before = engines["spec"].stats()
    passes = [run_pass(engines, prompts, f"{name}{r}") for r in range(repeats)]
    after = engines["spec"].stats()
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return summarize(name, passes, drafts, draft_tokens, accepted)


def summarize(
    name: str, passes: list[dict[str, Totals]], drafts: int, draft_tokens: int, accepted: int
) -> dict[str, Any]:
    """One table row: medians, the speedup and the acceptance figures."""
    plain = statistics.median(p["plain"].rate for p in passes)
    spec = statistics.median(p["spec"].rate for p in passes)
    speedup = spec / plain if plain else 0.0
    return {
        "workload": name,
        "plain_tok_s": plain,
        "spec_tok_s": spec,
        "speedup": speedup,
        "mean_accepted_len": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "target": f">= {TARGETS[name]}x: {'met' if speedup >= TARGETS[name] else 'missed'}",
        "passes": [{k: vars(v) for k, v in p.items()} for p in passes],
    }


def table(data: dict[str, Any]) -> str:
    """The Markdown section: title, CPU, settings and one row per workload."""
    head = (
        "### Speculative decoding (ngram), batch-1 decode\n\n"
        f"{cpu_line(data['cpu'])}; dtype {data['dtype']}; speculative config "
        f"`{data['speculative_config']}`; up to {data['max_tokens']} output tokens, greedy; "
        f"medians of {data['repeats']} passes.\n\n"
    )
    return head + markdown_table(data["rows"], COLUMNS)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--w1-requests", type=int, default=4, help="W1 requests per pass")
    p.add_argument("--repeats", type=int, default=3, help="passes; figures are medians")
    p.add_argument("--name", default="spec_decode", help="result file name")
    args = p.parse_args(argv)
    engines = {
        "plain": LLM(dtype=args.dtype, kv_cache_memory="512MiB", max_num_seqs=4),
        "spec": LLM(
            dtype=args.dtype, kv_cache_memory="512MiB", max_num_seqs=4, speculative_config=NGRAM
        ),
    }
    try:
        loads = workloads(engines["plain"], args.max_tokens, args.w1_requests)
        run_pass(engines, loads["repetitive"][:1] + loads["W1"][:1], "warmup")
        rows = [measure(engines, prompts, name, args.repeats) for name, prompts in loads.items()]
    finally:
        for llm in engines.values():
            llm.shutdown()
    data = {"cpu": cpu_info(), "dtype": args.dtype, "speculative_config": NGRAM,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows}  # fmt: skip
    text = table(data)
    write_results(args.name, data, text, RESULTS_DIR)
    print(text)
    return data


if __name__ == "__main__":
    main()
