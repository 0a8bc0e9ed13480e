"""Serving latency with the TPOT step budget off and on (`--target-tpot-ms`), interleaved.

Each round starts `tessera serve` once per configuration (the order reversed on odd
rounds, so a drift of the machine does not favour one) and runs the serving benchmark at
each rate; the table gives TTFT / TPOT / ITL p50 and p99 per configuration, rate and round.

    python -m benchmarks.step_budget_bench --targets 0,100,200 --rounds 2 --rates 1,2,4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import serve_bench
from benchmarks.report import RESULTS_DIR, cpu_info, cpu_line, markdown_table
from benchmarks.stack import start_stack

METRICS = ("ttft_ms", "tpot_ms", "itl_ms")


def run_config(target_ms: float, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One `tessera serve` with this target (0: off), benchmarked at every rate."""
    stack = start_stack(*(["--target-tpot-ms", str(target_ms)] if target_ms else []))
    try:
        argv = ["--base-url", stack.base_url, "--rates", args.rates, "--num-prompts"]
        argv += [str(args.num_prompts), "--out-dir", str(args.out_dir), "--name", name]
        return serve_bench.main([*argv, "--warmup", "4"])
    finally:
        stack.stop()


def rows(results: list[tuple[int, float, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (round, target, rate)."""
    out = []
    for round_index, target, data in results:
        for run in data["runs"]:
            row: dict[str, Any] = {
                "rate (req/s)": run["request_rate"],
                "target ms": target or "off",
                "round": round_index,
                "ok": f"{run['completed']}/{run['num_prompts']}",
                "out tok/s": run["output_throughput"],
            }
            for metric in METRICS:
                label = metric.removesuffix("_ms").upper()
                row[f"{label} p50"] = run[metric]["median"]
                row[f"{label} p99"] = run[metric]["p99"]
            out.append(row)
    return sorted(out, key=lambda r: (r["rate (req/s)"], str(r["target ms"]), r["round"]))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parser().parse_args(argv)
    targets = [float(t) for t in args.targets.split(",")]
    results = []
    for round_index in range(args.rounds):
        for target in targets if round_index % 2 == 0 else targets[::-1]:
            name = f"step_budget_r{round_index}_{target:g}"
            results.append((round_index, target, run_config(target, args, name)))
    table = rows(results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "step_budget.json").write_text(json.dumps(table, indent=1))
    text = f"### Serving latency, TPOT step budget off / on (ms)\n\n{cpu_line(cpu_info())}\n\n"
    text += markdown_table(table, list(table[0]))
    (args.out_dir / "step_budget.md").write_text(text)
    print(text)
    return table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--targets", default="0,100", help="--target-tpot-ms values; 0: off")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the targets")
    p.add_argument("--rates", default="1,2,4", help="request rates (serve_bench --rates)")
    p.add_argument("--num-prompts", type=int, default=24, help="prompts per rate")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    return p


if __name__ == "__main__":
    main()
