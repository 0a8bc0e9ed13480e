"""Writing benchmark results: JSON, a Markdown table and a PNG plot under bench-results/."""

from __future__ import annotations

import json
import os
import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("bench-results")
# CPU flags that decide which kernels are fast (bf16 is emulated without avx512_bf16/amx_bf16).
CPU_FLAGS = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8"]  # fmt: skip


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU model, its class, the CPU_FLAGS it has (read as the worker reads them) and the
    number of CPUs this process may run on."""
    from worker_service.cpu_kernels import read_cpu_info

    cpu = read_cpu_info(path)
    flags = [f for f in CPU_FLAGS if f in cpu.flags]
    return {"model": cpu.model, "cpu_class": cpu_class(flags), "flags": flags,
            "cpus": len(os.sched_getaffinity(0))}  # fmt: skip


def cpu_class(flags: list[str]) -> str:
    """The CPU class the kernels care about: AMX, AVX-512 BF16, AVX-512, AVX2 or other."""
    for flag, name in [("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"),
                       ("avx512f", "AVX-512"), ("avx2", "AVX2")]:  # fmt: skip
        if flag in flags:
            return name
    return "other"


def cpu_line(cpu: dict[str, Any]) -> str:
    """One line naming the CPU for titles and tables."""
    return f"CPU: {cpu['model']}, {cpu['cpus']} CPUs, class {cpu['cpu_class']} ({' '.join(cpu['flags'])})"


def ratio(ours: float | None, theirs: float | None, lower_is_better: bool = False) -> float | None:
    """How many times better Tessera is (>1: Tessera ahead); None when either side is missing."""
    if not ours or not theirs:
        return None
    return theirs / ours if lower_is_better else ours / theirs


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
    """A labelled bar chart saved as PNG (the title may have several lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    bars = ax.bar(labels, values, color=[colors[i % len(colors)] for i in range(len(values))])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_title(_wrap(title), fontsize=9)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _wrap(title: str, width: int = 80) -> str:
    """Plot titles: long lines (the CPU line) wrapped so they fit the figure."""
    return "\n".join("\n".join(textwrap.wrap(line, width)) for line in title.splitlines())


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
    ax.set_title(_wrap(title), fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
