"""The speculative decoding benchmark's report: medians, speedup, acceptance, targets."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import spec_decode
from benchmarks.report import cpu_info, write_results
from benchmarks.spec_decode import Totals, summarize, table
from benchmarks.spec_workload import SOURCE, TASKS, repetitive_chats


def _pass(plain: tuple[int, float], spec: tuple[int, float]) -> dict[str, Totals]:
    return {"plain": Totals(*plain), "spec": Totals(*spec)}


def test_summary_takes_medians_and_checks_the_target() -> None:
    passes = [
        _pass((100, 4.0), (100, 2.0)),
        _pass((100, 5.0), (100, 2.5)),
        _pass((100, 4.0), (100, 1.0)),
    ]
    row = summarize("repetitive", passes, drafts=50, draft_tokens=200, accepted=150)
    assert row["plain_tok_s"] == 25.0 and row["spec_tok_s"] == 50.0 and row["speedup"] == 2.0
    assert row["mean_accepted_len"] == 4.0 and row["acceptance_rate"] == 0.75
    assert row["target"] == ">= 1.5x: met"
    slow = summarize("W1", [_pass((100, 1.0), (100, 1.2))], drafts=0, draft_tokens=0, accepted=0)
    assert slow["target"] == ">= 0.95x: missed" and slow["mean_accepted_len"] == 1.0


def test_table_and_files(tmp_path: Path) -> None:
    row = summarize("W1", [_pass((10, 1.0), (10, 1.0))], 1, 4, 2)
    data = {"cpu": cpu_info(), "dtype": "bfloat16", "speculative_config": spec_decode.NGRAM,
            "max_tokens": 8, "repeats": 1, "rows": [row]}  # fmt: skip
    text = table(data)
    assert "CPU: " in text and "| W1 | 10.00 | 10.00 | 1.00 | 3.00 | 0.50 |" in text
    path = write_results("spec_decode", data, text, tmp_path)
    assert json.loads(path.read_text())["rows"][0]["accepted_tokens"] == 2
    assert (tmp_path / "spec_decode.md").read_text() == text


def test_the_repetitive_workload_carries_the_text() -> None:
    chats = repetitive_chats()
    assert len(chats) == len(TASKS) == 8 and len(SOURCE.split()) > 150
    assert all(SOURCE in chat[0]["content"] for chat in chats)
