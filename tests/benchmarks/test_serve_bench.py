"""The serving benchmark measures any OpenAI-compatible server the same way (issue 7, point 3).

The server here is not Tessera: a minimal OpenAI-style completions endpoint (bearer
auth, token-id prompts, one streamed chunk per token) that may or may not send the
`include_usage` chunk, as servers differ there.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from benchmarks import serve_bench
from benchmarks.workload import mixed_workload
from tests.conftest import free_port

KEY = "other-server-key"


def _app(send_usage: bool) -> Starlette:
    def authorized(request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {KEY}"

    async def models(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": "other-model", "object": "model"}]})

    async def completions(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        assert body["model"] == "other-model" and body["stream"] is True
        prompt, count = body["prompt"], body["max_tokens"]

        async def events() -> AsyncIterator[str]:
            for _ in range(count):
                await asyncio.sleep(0.001)
                yield json.dumps(
                    {"object": "text_completion", "choices": [{"index": 0, "text": "a"}]}
                )
            if send_usage:
                usage = {"prompt_tokens": len(prompt), "completion_tokens": count}
                yield json.dumps({"choices": [], "usage": usage})
            yield "[DONE]"

        return EventSourceResponse(events())

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


@pytest.fixture(params=[True, False], ids=["usage", "no-usage"])
def other_server(request: pytest.FixtureRequest) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(_app(request.param), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _bench(base_url: str, out: Path, *extra: str) -> dict:
    argv = ["--base-url", base_url, "--rates", "inf,20", "--num-prompts", "6", "--warmup", "1"]
    return serve_bench.main([*argv, "--vocab-size", "1000", "--out-dir", str(out), *extra])


def test_measures_another_openai_server(other_server: str, tmp_path: Path) -> None:
    data = _bench(other_server, tmp_path, "--api-key", KEY)
    assert data["model"] == "other-model"
    assert [r["request_rate"] for r in data["runs"]] == [float("inf"), 20.0]
    for seed, run in enumerate(data["runs"]):  # each rate its own prompts (seed + rate index)
        expected = mixed_workload(6, vocab_size=1000, seed=seed)
        out_tokens = sum(r.output_len for r in expected)
        in_tokens = sum(len(r.prompt_token_ids) for r in expected)
        assert run["seed"] == seed
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["output_throughput"] * run["duration_s"] == pytest.approx(out_tokens)
        total = run["total_token_throughput"] * run["duration_s"]
        assert total == pytest.approx(in_tokens + out_tokens)
        assert 0 < run["ttft_ms"]["median"] <= run["e2el_ms"]["median"]
        assert run["tpot_ms"]["median"] > 0 and run["itl_ms"]["median"] > 0
    assert {p.name for p in tmp_path.iterdir()} == {"serve.json", "serve.md", "serve.png"}
    assert "| inf | 6 | 6 |" in (tmp_path / "serve.md").read_text()


def test_rejected_requests_are_counted_not_crashed(other_server: str, tmp_path: Path) -> None:
    data = _bench(other_server, tmp_path, "--api-key", "wrong", "--model", "other-model")
    for run in data["runs"]:
        assert run["completed"] == 0 and run["failed"] == 6
        assert run["errors"] and run["errors"][0].startswith("HTTP 401")


def test_one_prompt_count_per_rate() -> None:
    assert serve_bench.prompt_counts("64,32,48", 1) == [64]
    assert serve_bench.prompt_counts("64,32,48", 3) == [64, 32, 48]
    assert serve_bench.prompt_counts("6", 2) == [6, 6]
