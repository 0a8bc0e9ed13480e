"""`make bench` / `tessera bench all`: every benchmark in one run, then the README table.

Runs the decode micro-benchmark, offline throughput (with HF in the same run),
the per-step scheduler + gRPC overhead, scheduler CPU time, and online serving against a `tessera serve` it starts itself.
Results land in bench-results/ (JSON, Markdown, PNG); the README's table between
the bench markers is replaced with the combined Markdown.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import RESULTS_DIR
from services.healthcheck import http_healthy

README = Path("README.md")
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
SECTIONS = ["decode", "offline", "serve", "step_overhead", "scheduler"]


def run_module(name: str, argv: list[str]) -> None:
    print(f"== benchmarks.{name} {' '.join(argv)}", flush=True)
    importlib.import_module(f"benchmarks.{name}").main(argv)


def serve_and_bench(port: int, serve_args: list[str], bench_args: list[str]) -> None:
    """Start `tessera serve`, wait for /health, run the serving benchmark, stop the server."""
    argv = [sys.executable, "-m", "tessera", "serve", "--port", str(port), *serve_args]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not http_healthy(f"http://127.0.0.1:{port}/health", 2):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tessera serve did not start for the serving benchmark")
            time.sleep(0.5)
        run_module("serve_bench", ["--base-url", f"http://127.0.0.1:{port}", *bench_args])
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)


def update_readme(out_dir: Path) -> None:
    """Replace the README's bench section with the Markdown tables and plots of this run."""
    parts = []
    for name in SECTIONS:
        table = out_dir / f"{name}.md"
        if table.exists():
            parts.append(table.read_text().strip())
            if (out_dir / f"{name}.png").exists():
                parts.append(f"![{name}]({out_dir.name}/{name}.png)")
    text = README.read_text()
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + START + "\n\n" + "\n\n".join(parts) + "\n\n" + END + rest.split(END, 1)[1]
        README.write_text(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--port", type=int, default=8123, help="port of the server the serving bench starts"
    )
    p.add_argument(
        "--skip", nargs="*", default=[], choices=SECTIONS, help="benchmarks to leave out"
    )
    args = p.parse_args(argv)
    if "decode" not in args.skip:
        run_module("decode_bench", [])
    if "offline" not in args.skip:
        run_module("offline_bench", [])
    if "step_overhead" not in args.skip:
        run_module("step_overhead_bench", ["--repeat", "2"])
    if "scheduler" not in args.skip:
        run_module("scheduler_bench", [])
    if "serve" not in args.skip:
        serve_and_bench(args.port, [], [])
    update_readme(RESULTS_DIR)


if __name__ == "__main__":
    main()
