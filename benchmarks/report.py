"""Writing benchmark results: JSON, a Markdown table and a PNG plot under bench-results/."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("bench-results")


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and p99 of `values` (zeros when empty)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": p99}


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A Markdown table of `rows` restricted to `columns` (floats with 2 decimals)."""

    def cell(value: Any) -> str:
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(name: str, data: dict[str, Any], table: str, out_dir: Path = RESULTS_DIR) -> Path:
    """Write `<name>.json` and `<name>.md` under out_dir; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(table)
    return path


def bar_plot(path: Path, title: str, labels: list[str], values: list[float], ylabel: str) -> None:
    """A labelled bar chart saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, values, color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][: len(values)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def line_plot(
    path: Path,
    title: str,
    xs: list[float],
    series: dict[str, list[float]],
    xlabel: str,
    ylabel: str,
) -> None:
    """One line per series against xs, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
