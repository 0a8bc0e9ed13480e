"""`make bench` / `tessera bench all`: every benchmark in one run, then the tables of docs/benchmarks.md.

Runs the decode micro-benchmark and offline throughput (HF and vLLM in the same run),
the per-step scheduler + gRPC overhead, scheduler CPU time, speculative decoding (batch-1
decode with and without ngram drafts), multi-LoRA throughput (4 adapters mixed against base
only), the weight formats' quality and decode speed (fp32, bf16, int8, the GGUF file, and
llama.cpp on that file), and
online serving against
a `tessera serve` and a vLLM OpenAI server it starts itself, one after the other, with
the same client, prompts and rates. vLLM's CPU build lives in its own venv (`--vllm-venv`,
installed on first use); if it cannot be installed or run, the results say so and the
rest is still measured. `--quick` (`make bench-quick`) runs the offline benchmark only.
Results land in bench-results/ (JSON, Markdown, PNG); the part of docs/benchmarks.md between
the bench markers is replaced with the combined Markdown (not by `--quick`).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import serve_compare
from benchmarks.report import RESULTS_DIR, cpu_info
from benchmarks.vllm_env import (
    DEFAULT_VENV,
    VllmEnv,
    VllmUnavailable,
    ensure_installed,
    serving,
)
from services.default_model import resolve_model
from services.healthcheck import http_healthy

BENCH_DOC = Path("docs/benchmarks.md")  # its bench section is replaced by each run
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
SECTIONS = [
    "decode", "attention", "offline", "serve", "step_overhead", "scheduler", "spec_decode", "lora",
    "quality",
]  # fmt: skip


def run_module(name: str, argv: list[str]) -> Any:
    """Run benchmarks.<name>.main(argv), printing what runs and how long it took."""
    print(f"== benchmarks.{name} {' '.join(argv)}", flush=True)
    start = time.monotonic()
    result = importlib.import_module(f"benchmarks.{name}").main(argv)
    print(f"== benchmarks.{name} took {time.monotonic() - start:.0f} s", flush=True)
    return result


def serve_and_bench(port: int, serve_args: list[str], bench_args: list[str]) -> Any:
    """Start `tessera serve`, wait for /health, run the serving benchmark, stop the server."""
    argv = [sys.executable, "-m", "tessera", "serve", "--port", str(port), *serve_args]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not http_healthy(f"http://127.0.0.1:{port}/health", 2):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tessera serve did not start for the serving benchmark")
            time.sleep(0.5)
        return run_module("serve_bench", ["--base-url", f"http://127.0.0.1:{port}", *bench_args])
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)


def serve_vllm_and_bench(env: VllmEnv, port: int, bench_args: list[str]) -> Any:
    """The same serving benchmark against vLLM's OpenAI server on the default model."""
    with serving(env, str(resolve_model("default")), port) as base_url:
        return run_module("serve_bench", ["--base-url", base_url, *bench_args])


def serve_both(port: int, env: VllmEnv | None) -> None:
    """Serving for Tessera (bf16, then its Q4_1 GGUF at rate inf), then vLLM (unless env is
    None), then the side-by-side files (each run's own files go to a scratch directory)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = ["--out-dir", scratch]
        tessera = serve_and_bench(port, [], ["--name", "serve_tessera", *out])
        gguf = serve_and_bench(
            port,
            ["--quantization", "gguf"],
            ["--name", "serve_tessera_gguf", "--rates", "inf", *out],
        )
        vllm, error = None, "left out (--skip vllm)" if env is None else None
        if env is not None:
            try:
                vllm = serve_vllm_and_bench(env, port, ["--name", "serve_vllm", *out])
            except VllmUnavailable as exc:
                error = str(exc)
                print(f"vLLM: {error}", flush=True)
    data = serve_compare.combine(tessera, vllm, error, cpu_info(), RESULTS_DIR, gguf)
    print(serve_compare.table(data))


def vllm_args(args: argparse.Namespace) -> tuple[VllmEnv | None, list[str]]:
    """vLLM's env (None when left out) and the benches' vLLM options. The install is tried
    once, here; after a failure each bench reports vLLM unavailable with its reason."""
    if "vllm" in args.skip:
        return None, ["--skip-vllm"]
    env = VllmEnv(args.vllm_venv, kv_cache_gib=args.vllm_kv_cache_gib)
    try:
        ensure_installed(env)
    except VllmUnavailable as exc:
        print(f"vLLM: {exc}; the benchmarks go on without it", flush=True)
    argv = ["--vllm-venv", str(args.vllm_venv), "--vllm-kv-cache-gib", str(env.kv_cache_gib)]
    return replace(env, install=False), [*argv, "--no-vllm-install"]


def update_bench_doc(out_dir: Path) -> None:
    """Replace the bench section of docs/benchmarks.md with the Markdown tables and plots of this run."""
    parts = []
    for name in SECTIONS:
        table = out_dir / f"{name}.md"
        if table.exists():
            parts.append(table.read_text().strip())
            if (out_dir / f"{name}.png").exists():
                parts.append(f"![{name}](../{out_dir.name}/{name}.png)")  # from docs/
    text = BENCH_DOC.read_text()
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + START + "\n\n" + "\n\n".join(parts) + "\n\n" + END + rest.split(END, 1)[1]
        BENCH_DOC.write_text(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--port", type=int, default=8123, help="port of the servers the serving bench starts"
    )
    p.add_argument(
        "--skip", nargs="*", default=[], choices=[*SECTIONS, "vllm"],
        help="benchmarks (or the vLLM engine) to leave out",
    )  # fmt: skip
    p.add_argument(
        "--quick", action="store_true", help="offline W1 only; docs/benchmarks.md left as is"
    )
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="vLLM's virtualenv")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    args = p.parse_args(argv)
    start = time.monotonic()
    env, vllm_argv = vllm_args(args)
    skip = set(SECTIONS) - {"offline"} if args.quick else set(args.skip)
    if "decode" not in skip:
        run_module("decode_bench", vllm_argv)
    if "attention" not in skip:
        run_module("attention_bench", [])
    if "offline" not in skip:
        run_module("offline_bench", vllm_argv)
    if "step_overhead" not in skip:
        run_module("step_overhead_bench", ["--repeat", "2"])
    if "scheduler" not in skip:
        run_module("scheduler_bench", [])
    if "spec_decode" not in skip:
        run_module("spec_decode", [])
    if "lora" not in skip:
        run_module("lora_bench", [])
    if "quality" not in skip:
        run_module("quality", [])
    if "serve" not in skip:
        serve_both(args.port, env)
    if not args.quick:
        update_bench_doc(RESULTS_DIR)
    print(f"== all benchmarks took {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
