"""Online serving benchmark, like `vllm bench serve`, against any OpenAI-compatible server.

Sends the "mixed" workload as token-id prompts to /v1/completions (stream,
include_usage, ignore_eos) with Poisson arrivals at each request rate, and
reports throughput, TTFT, TPOT, ITL and end-to-end latency, plus goodput.
Any server that speaks the OpenAI completions API is measured the same way:
`--api-key` (or $OPENAI_API_KEY) is sent as a bearer token, and a server that
sends no usage chunk has its output tokens counted as streamed text chunks.
Each rate draws fresh prompts (seed + the rate's index), so a prefix cache never
serves one rate from the prompts of another.

    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000 --rates inf,1,2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.report import RESULTS_DIR, line_plot, markdown_table, summarize, write_results
from benchmarks.workload import BenchRequest, mixed_workload


@dataclass
class RequestResult:
    """What one streamed request measured (seconds)."""

    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    error: str = ""

    @property
    def tpot(self) -> float:
        return (
            (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0
        )


async def send(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest) -> RequestResult:
    """Stream one completion and time its chunks."""
    body = {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result, start = RequestResult(), time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as reply:
            if reply.status_code != 200:
                result.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return result
            async for line in reply.aiter_lines():
                last = _on_line(line, result, start, last)
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.usage_reported:
            result.prompt_tokens = len(req.prompt_token_ids)
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


def _on_line(line: str, result: RequestResult, start: float, last: float) -> float:
    """Account one SSE line; returns the time of the latest token chunk."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return last
    chunk = json.loads(line[6:])
    if chunk.get("usage"):
        result.prompt_tokens = chunk["usage"]["prompt_tokens"]
        result.output_tokens = chunk["usage"]["completion_tokens"]
        result.usage_reported = True
    if not chunk.get("choices"):
        return last
    now = time.perf_counter()
    if not result.usage_reported:
        result.output_tokens += 1  # no usage (yet): one chunk per token, as servers stream
    if result.ttft == 0.0:
        result.ttft = now - start
    else:
        result.itls.append(now - last)
    return now


def _client(api_key: str, connections: int = 16) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits, headers=headers)


async def run_rate(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    rate: float,
    seed: int,
    api_key: str = "",
) -> tuple[list[RequestResult], float]:
    """Send `requests` with Poisson arrivals at `rate` req/s (inf: all at once)."""
    rng = random.Random(seed)
    async with _client(api_key, len(requests) + 8) as client:
        url = f"{base_url.rstrip('/')}/v1/completions"
        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(send(client, url, model, req)))
            if not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def metrics(
    results: list[RequestResult], duration: float, slo_ms: dict[str, float]
) -> dict[str, Any]:
    """Aggregate figures of one rate (latencies in ms)."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    good = [r for r in done if _meets(r, slo_ms)]
    ms = lambda xs: {k: v * 1000 for k, v in summarize(xs).items()}  # noqa: E731
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": len(good) / duration,
        "ttft_ms": ms([r.ttft for r in done]),
        "tpot_ms": ms([r.tpot for r in done if r.output_tokens > 1]),
        "itl_ms": ms([x for r in done for x in r.itls]),
        "e2el_ms": ms([r.latency for r in done]),
    }


def _meets(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return all(measured[k] * 1000 <= v for k, v in slo_ms.items())


async def served_model(base_url: str, api_key: str) -> str:
    async with _client(api_key) as client:
        reply = await client.get(f"{base_url.rstrip('/')}/v1/models")
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])


def prompt_counts(num_prompts: str, rates: int) -> list[int]:
    """--num-prompts ("64,32,48") -> one count per rate: the last repeats, extra ones unused."""
    counts = [int(n) for n in num_prompts.split(",")]
    return (counts + [counts[-1]] * rates)[:rates]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or await served_model(args.base_url, args.api_key)
    rates = [float(r) for r in args.rates.split(",")]
    counts = prompt_counts(args.num_prompts, len(rates))
    slo = (
        dict((k, float(v)) for k, v in (item.split(":") for item in args.goodput))
        if args.goodput
        else {}
    )
    if args.warmup:
        warmup = mixed_workload(args.warmup, vocab_size=args.vocab_size, seed=args.seed + 99)
        await run_rate(args.base_url, model, warmup, math.inf, 0, args.api_key)
    runs = []
    for i, (rate, count) in enumerate(zip(rates, counts, strict=True)):
        seed = args.seed + i  # fresh prompts per rate: no hits on an earlier rate's prefixes
        requests = mixed_workload(count, vocab_size=args.vocab_size, seed=seed)
        results, duration = await run_rate(args.base_url, model, requests, rate, seed, args.api_key)
        figures = metrics(results, duration, slo)
        runs.append({"request_rate": rate, "num_prompts": count, "seed": seed, **figures})
        print(f"rate {rate}: {runs[-1]['output_throughput']:.1f} output tok/s, "
              f"TTFT p50 {runs[-1]['ttft_ms']['median']:.1f} ms, TPOT p50 {runs[-1]['tpot_ms']['median']:.1f} ms",
              flush=True)  # fmt: skip
    return {"base_url": args.base_url, "model": model, "slo_ms": slo, "runs": runs}


def table(data: dict[str, Any]) -> str:
    rows = [
        {
            "rate (req/s)": str(r["request_rate"]),
            "prompts": r["num_prompts"],
            "ok": r["completed"],
            "req/s": r["request_throughput"],
            "out tok/s": r["output_throughput"],
            "TTFT p50 ms": r["ttft_ms"]["median"],
            "TTFT p99 ms": r["ttft_ms"]["p99"],
            "TPOT p50 ms": r["tpot_ms"]["median"],
            "ITL p50 ms": r["itl_ms"]["median"],
            "E2E p50 ms": r["e2el_ms"]["median"],
            "goodput req/s": r["goodput"],
        }
        for r in data["runs"]
    ]
    return f"### Online serving ({data['model']} at {data['base_url']})\n\n" + markdown_table(
        rows, list(rows[0])
    )


def plot(data: dict[str, Any], path: Path) -> None:
    runs = [r for r in data["runs"] if not math.isinf(r["request_rate"])]
    if not runs:
        return
    xs = [r["request_rate"] for r in runs]
    series = {f"{m} p50": [r[f"{m}_ms"]["median"] for r in runs] for m in ("ttft", "tpot", "itl")}
    line_plot(path, "Latency against request rate", xs, series, "request rate (req/s)", "ms")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="bearer token to send"
    )
    p.add_argument("--rates", default="inf,1,2", help="comma-separated request rates (inf allowed)")
    p.add_argument(
        "--num-prompts",
        default="64,32,48",
        help="prompts per rate, in order (the last one repeats; extra ones are unused)",
    )
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before measuring")
    p.add_argument(
        "--goodput", nargs="*", default=["ttft:500", "tpot:50"], help="SLOs as metric:ms"
    )
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument(
        "--seed", type=int, default=0, help="workload seed of the first rate; rate i uses seed + i"
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default="serve", help="file stem of the results (NAME.json, .md)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    data = asyncio.run(bench(args))
    write_results(args.name, data, table(data), args.out_dir)
    plot(data, args.out_dir / f"{args.name}.png")
    print(table(data))
    return data


if __name__ == "__main__":
    main()
