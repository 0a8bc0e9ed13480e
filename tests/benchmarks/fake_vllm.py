"""A stand-in for vLLM's offline API, installed into a throwaway venv by the tests so the
benchmark's vLLM plumbing (venv, subprocess, job and result files, figures) runs for real
without vLLM. It records each call in calls.jsonl beside itself and sleeps 1 ms per
generated token so timings are positive and grow with the work."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__version__ = "0.0-fake"
CALLS = Path(__file__).with_name("calls.jsonl")


def _record(entry: dict[str, Any]) -> None:
    with CALLS.open("a") as out:
        out.write(json.dumps(entry) + "\n")


class SamplingParams:
    def __init__(self, temperature: float, max_tokens: int, ignore_eos: bool) -> None:
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids


class _RequestOutput:
    def __init__(self, token_ids: list[int]) -> None:
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, **kwargs: Any) -> None:
        env = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE")}
        _record({"init": kwargs, "env": env})

    def generate(
        self, prompts: list[dict[str, list[int]]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[_RequestOutput]:
        ids = [p["prompt_token_ids"] for p in prompts]
        assert all(isinstance(t, int) for p in ids for t in p)
        _record(
            {"prompt_lens": [len(p) for p in ids], "max_tokens": [p.max_tokens for p in params]}
        )
        time.sleep(0.001 * sum(p.max_tokens for p in params))
        return [_RequestOutput([7] * p.max_tokens) for p in params]
