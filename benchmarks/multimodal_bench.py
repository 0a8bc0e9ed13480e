"""Image requests through `tessera serve`: requests/s and TTFT p50 of one-image prompts with
the pixels sent as shared-memory handles vs inline bytes, in the same run.

The model is a random LLaVA with a CLIP-L-sized input (336 x 336, patch 14: 576 image
tokens, 1.35 MB of float32 pixels per image) and a tiny vision tower and LM, so the
figure is dominated by the request path (decode, processor, handle transport), not by
model compute. Every request sends a different image (no prefix-cache hits).

  python -m benchmarks.multimodal_bench [--requests 48] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.report import cpu_info, cpu_line, markdown_table, write_results
from benchmarks.stack import start_stack
from benchmarks.tiny_vlm import build_tiny_llava, png_bytes, sample_image
from services.default_model import resolve_model

IMAGE_SIZE, PATCH = 336, 14


def _body(model: str, seed: int) -> dict[str, Any]:
    png = png_bytes(sample_image(seed, (IMAGE_SIZE, IMAGE_SIZE)))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip


async def _one(client: httpx.AsyncClient, body: dict[str, Any]) -> float:
    """Seconds to the first content chunk."""
    start = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        ttft = 0.0
        async for line in reply.aiter_lines():
            if not ttft and '"content"' in line:
                ttft = time.perf_counter() - start
    return ttft


async def _load(base_url: str, n: int, concurrency: int, seed0: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        bodies = [_body(model, seed0 + i) for i in range(n)]  # encoded before the clock runs
        await _one(client, _body(model, seed0 - 1))  # warm-up
        semaphore = asyncio.Semaphore(concurrency)

        async def limited(body: dict[str, Any]) -> float:
            async with semaphore:
                return await _one(client, body)

        start = time.perf_counter()
        ttfts = await asyncio.gather(*(limited(b) for b in bodies))
        elapsed = time.perf_counter() - start
    return {"requests_per_s": n / elapsed, "ttft_p50_ms": 1000 * statistics.median(ttfts)}


def run(n: int, concurrency: int) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llava(
            Path(tmp) / "llava", resolve_model("default"), image_size=IMAGE_SIZE, patch=PATCH
        )
        for i, transport in enumerate(("shm", "inline")):
            stack = start_stack(
                "--model", str(model_dir), "--dtype", "float32", "--image-transport", transport
            )
            try:
                figures = asyncio.run(_load(stack.base_url, n, concurrency, 1000 * (i + 1)))
            finally:
                stack.stop()
            rows.append({"transport": transport, **figures})
    load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    return {"cpu": cpu_info(), "load_1min": load, "requests": n, "concurrency": concurrency,
            "rows": rows}  # fmt: skip


def table(data: dict[str, Any]) -> str:
    title = (
        f"### Image requests, one {IMAGE_SIZE}x{IMAGE_SIZE} image per prompt "
        f"({data['requests']} requests, concurrency {data['concurrency']}, tiny random LLaVA)"
    )
    columns = ["transport", "requests_per_s", "ttft_p50_ms"]
    load = f"1-minute load average at the end: {data['load_1min']:.1f}"
    header = f"{title}\n\n{cpu_line(data['cpu'])}; {load}\n\n"
    return header + markdown_table(data["rows"], columns)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="multimodal_bench", description=__doc__)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=1)
    args = p.parse_args(argv)
    data = run(args.requests, args.concurrency)
    print(table(data))
    write_results("multimodal", data, table(data))
    return data


if __name__ == "__main__":
    main()
