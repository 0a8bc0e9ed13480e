"""Cost of structured output: batch-32 decode with a JSON schema on every request vs none.

    python -m benchmarks.structured_bench [--batch 32] [--steps 32] [--repeats 3]

Drives the in-process Worker (no gRPC, no scheduler) with hand-built SchedulerOutputs:
prefill `batch` chat prompts, then time `steps` decode steps. Both modes sample at
temperature 1.0 with per-request seeds; the constrained mode gives every request the same
JSON schema (an array of at least 64 records, so no request can finish its grammar within
the measured steps and every step pays for a full mask). Modes alternate within each repeat
so drift on a shared machine hits both; the figure is the ratio of median throughputs
(issue 15 asks for >= 85%). Writes bench-results/structured.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS_DIR, markdown_table, write_results
from services.config import ModelConfig, WorkerConfig
from services.default_model import resolve_model
from services.step_types import CachedRequestData, NewRequestData, SchedulerOutput
from services.types import SamplingParams, StructuredOutputParams
from worker_service.worker import Worker, configure_threads

BLOCK = 16
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "minItems": 64, "items": RECORD}
PROMPT = "List the members of a software team as a JSON array of records."


class StructuredBench:
    """One Worker; `decode(constrained)` times the decode steps of one batch."""

    def __init__(self, dtype: str, batch: int, steps: int) -> None:
        self.worker = Worker(WorkerConfig(model=ModelConfig(dtype=dtype), max_num_seqs=batch))  # type: ignore[arg-type]
        self.batch, self.steps, self.step_id, self.runs = batch, steps, 0, 0
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(resolve_model("default"))
        text = tok.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
        )
        self.prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        self.blocks_each = -(-(len(self.prompt) + steps + 2) // BLOCK)
        self.worker.initialize_cache(batch * self.blocks_each)

    def _run(self, so: SchedulerOutput) -> None:
        self.step_id += 1
        so.step_id = self.step_id
        out = self.worker.execute_model(so)
        assert not out.request_errors, out.request_errors

    def decode(self, constrained: bool) -> float:
        """Seconds for `steps` decode steps of the batch (prefill not timed)."""
        self.runs += 1
        constraint = StructuredOutputParams(json=json.dumps(SCHEMA)) if constrained else None
        ids = [f"r{self.runs}-{i}" for i in range(self.batch)]
        n = len(self.prompt)
        news = [
            NewRequestData(
                rid,
                self.prompt,
                [],
                SamplingParams(
                    temperature=1.0, seed=i, max_tokens=4096, structured_output=constraint
                ),
                list(range(i * self.blocks_each, (i + 1) * self.blocks_each)),
            )
            for i, rid in enumerate(ids)
        ]
        self._run(
            SchedulerOutput(0, news, CachedRequestData(), dict.fromkeys(ids, n), self.batch * n)
        )
        start = time.perf_counter()
        for k in range(self.steps):
            cached = CachedRequestData.of((r, n + k, []) for r in ids)
            self._run(SchedulerOutput(0, [], cached, dict.fromkeys(ids, 1), self.batch))
        elapsed = time.perf_counter() - start
        self._run(SchedulerOutput(0, finished_req_ids=ids))
        return elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    threads = configure_threads(args.num_threads)
    bench = StructuredBench(args.dtype, args.batch, args.steps)
    bench.decode(True)  # warm-up: tokenizer info, grammar compile, first-step allocations
    bench.decode(False)
    times: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.repeats):
        for mode, constrained in (("unconstrained", False), ("json_schema", True)):
            times[mode].append(bench.decode(constrained))
            print(f"{mode}: {times[mode][-1]:.2f} s", flush=True)
    tok_s = {k: args.batch * args.steps / statistics.median(v) for k, v in times.items()}
    results = {
        "dtype": args.dtype,
        "threads": threads,
        "batch": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "decode_tok_s": tok_s,
        "seconds": times,
        "ratio": tok_s["json_schema"] / tok_s["unconstrained"],
    }
    write_results("structured", results, table(results), args.out_dir)
    print(table(results))
    return results


def table(results: dict[str, Any]) -> str:
    rows = [{"mode": mode, "tokens/s": v} for mode, v in results["decode_tok_s"].items()]
    rows.append(
        {"mode": "json_schema / unconstrained", "tokens/s": f"{100 * results['ratio']:.1f}%"}
    )
    return markdown_table(rows, ["mode", "tokens/s"])


if __name__ == "__main__":
    main()
