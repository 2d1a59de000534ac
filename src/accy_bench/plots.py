"""Figures of the benchmark results, as PNG files beside their tables (optional: matplotlib).

``accy-async bench`` and ``accy-async bench workload`` write them when matplotlib is
installed (``pip install 'accy-async[plots]'``); they can also be made again from results
already written::

    python -m accy_bench.plots benchmarks/results/cuda-bench.json --out benchmarks/results/
    python -m accy_bench.plots benchmarks/results/app-workload.json --out benchmarks/results/

* from a launch bench (``bench.json``): ``launch-cost.png``, each path's host cost beside
  the raw ``cuLaunchKernel`` measured interleaved with it and the other libraries' anchors;
  ``completion-<length>.png``, each way of waiting's median and p90 latency with the CPU
  it used;
* from the application workloads (``workload.json``): ``workload-completion.png``, the
  median, p90 and p99 of the default waits and their baselines for every workload;
* from the kernel bench (``kernels.json``): ``kernels-bandwidth.png``, the bandwidth each
  implementation of each kernel reached at each size, beside 4 TB/s and the device's peak;
* from the tuning benchmark (``tuning.json``, ``benchmarks/tuning_bench.py``):
  ``tuning-wall.png``, each run's wall time concurrent and one candidate after another.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "available",
    "main",
    "plot_bench",
    "plot_kernels",
    "plot_tuning",
    "plot_workload",
    "write_with_figures",
]


def available() -> bool:
    """Whether matplotlib is installed (the figures are optional)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_with_figures(
    result: dict[str, Any],
    text: str,
    out: Path,
    stem: str,
    plot: Callable[[dict[str, Any], Path], list[Path]],
) -> None:
    """Write ``stem.json`` and ``stem.md`` (``text``) to ``out``, print the text, draw ``plot``.

    The figures only where matplotlib is installed; each one's path is printed.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(text)
    print(text)
    if available():
        for path in plot(result, out):
            print(f"figure: {path}")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_bench(result: dict[str, Any], out: Path) -> list[Path]:
    """The launch-cost and completion figures of a ``bench.json`` document; their paths."""
    plt = _pyplot()
    written = []
    launch = result.get("launch_us", {})
    rows = [
        (name, value["us"], value["raw_us"]) if isinstance(value, dict) else (name, value, None)
        for name, value in launch.items()
        if isinstance(value, dict | float | int)
    ]
    if rows:
        figure, axes = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.5))
        names = [name for name, _, _ in rows][::-1]
        values = [us for _, us, _ in rows][::-1]
        raws = [raw for _, _, raw in rows][::-1]
        positions = range(len(rows))
        axes.barh(positions, values, color=["#3b7dd8" if r is not None else "#999" for r in raws])
        for position, raw in zip(positions, raws, strict=True):
            if raw is not None:
                axes.plot([raw, raw], [position - 0.4, position + 0.4], color="black", lw=1)
        axes.set_yticks(list(positions), names, fontsize=7)
        axes.set_xlabel(
            "host µs per launch (per node or stage); black: raw cuLaunchKernel beside it"
        )
        axes.set_title(f"Launch cost, {result.get('device', '')}", fontsize=9)
        written.append(_save(figure, out / "launch-cost.png", plt))
    for length, ways in result.get("latency", {}).items():
        measured = [(name, row) for name, row in ways.items() if row.get("median_us") is not None]
        if not measured:
            continue
        figure, axes = plt.subplots(figsize=(10, 0.3 * len(measured) + 1.5))
        names = [name for name, _ in measured][::-1]
        positions = range(len(measured))
        medians = [row["median_us"] for _, row in measured][::-1]
        p90s = [row["p90_us"] for _, row in measured][::-1]
        cores = [row.get("cpu_cores") or 0.0 for _, row in measured][::-1]
        axes.barh(positions, p90s, color="#c7d7f0", label="p90")
        axes.barh(positions, medians, color="#3b7dd8", label="median")
        for position, core in zip(positions, cores, strict=True):
            axes.text(max(p90s) * 1.01, position, f"{core:.2f} cores", va="center", fontsize=6)
        axes.set_yticks(list(positions), names, fontsize=6)
        axes.set_xscale("log")
        axes.set_xlabel("µs from the kernel's end until the waiter runs (log)")
        axes.set_title(
            f"Completion latency, {length} kernel, {result.get('device', '')}", fontsize=9
        )
        axes.legend(fontsize=7, loc="lower right")
        written.append(_save(figure, out / f"completion-{length}.png", plt))
    return written


def plot_workload(result: dict[str, Any], out: Path) -> list[Path]:
    """The completion figure of an application-workload ``workload.json``; its path."""
    plt = _pyplot()
    completion = result.get("completion", {})
    if not completion:
        return []
    workloads = list(completion)
    figure, grid = plt.subplots(
        len(workloads), 1, figsize=(10, 2.6 * len(workloads)), squeeze=False
    )
    for axes, workload in zip(grid[:, 0], workloads, strict=True):
        ways = [
            (name, row)
            for name, row in completion[workload].items()
            if "default" in name or "every 120 us" in name or "reactor only" in name
        ]
        names = [name for name, _ in ways][::-1]
        positions = range(len(ways))
        for key, colour in (("p99_us", "#e3ebf7"), ("p90_us", "#9db9e6"), ("median_us", "#3b7dd8")):
            axes.barh(positions, [row[key] for _, row in ways][::-1], color=colour, label=key[:-3])
        axes.set_yticks(list(positions), names, fontsize=6)
        axes.set_xscale("log")
        axes.set_title(workload, fontsize=8)
        axes.legend(fontsize=6, loc="lower right")
    grid[-1, 0].set_xlabel("µs from the kernel's end until the task runs (log)")
    figure.suptitle(f"Completion on application workloads, {result.get('device', '')}", fontsize=9)
    return [_save(figure, out / "workload-completion.png", plt)]


def plot_kernels(result: dict[str, Any], out: Path) -> list[Path]:
    """The bandwidth figure of a kernel bench's ``kernels.json``; its path."""
    plt = _pyplot()
    by_kernel: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for row in result.get("rows", []):
        lines = by_kernel.setdefault(row["kernel"], {})
        lines.setdefault(row["implementation"], []).append(
            (row["n"], row["bytes_per_second"] / 1e9)
        )
    if not by_kernel:
        return []
    figure, grid = plt.subplots(1, len(by_kernel), figsize=(4 * len(by_kernel), 3.4), squeeze=False)
    for axes, (kernel, lines) in zip(grid[0], by_kernel.items(), strict=True):
        for name, points in lines.items():
            style = "-o" if name.startswith("accy") else "--."
            axes.plot([n for n, _ in points], [g for _, g in points], style, label=name, ms=3)
        axes.axhline(result["floor_bytes_per_second"] / 1e9, color="grey", lw=0.8, ls=":")
        if result.get("peak_bytes_per_second"):
            axes.axhline(result["peak_bytes_per_second"] / 1e9, color="black", lw=0.8, ls=":")
        axes.set_xscale("log")
        axes.set_title(kernel, fontsize=9)
        axes.set_xlabel("elements", fontsize=8)
        axes.legend(fontsize=6, loc="upper left")
    grid[0, 0].set_ylabel("GB/s the kernel must move (dotted: 4 TB/s, peak)", fontsize=8)
    figure.suptitle(f"Built-in kernels, {result.get('device', '')}", fontsize=9)
    return [_save(figure, out / "kernels-bandwidth.png", plt)]


def plot_tuning(result: dict[str, Any], out: Path) -> list[Path]:
    """The wall-time figure of a tuning benchmark's ``tuning.json``; its path.

    One pair of bars per run: tuning every problem concurrently (compiled in a
    process pool while others are measured) against one candidate after
    another, with the ratio above each pair.
    """
    plt = _pyplot()
    runs = result.get("runs", [])
    if not runs:
        return []
    figure, axes = plt.subplots(figsize=(6, 3.2))
    positions = range(len(runs))
    concurrent = [run["concurrent"]["wall_seconds"] for run in runs]
    sequential = [run["sequential"]["wall_seconds"] for run in runs]
    axes.bar([i - 0.2 for i in positions], concurrent, width=0.4, label="concurrent")
    axes.bar([i + 0.2 for i in positions], sequential, width=0.4, label="one after another")
    for i, (fast, slow) in enumerate(zip(concurrent, sequential, strict=True)):
        axes.annotate(f"{fast / slow:.2f}x", (i, max(fast, slow)), ha="center", va="bottom")
    axes.set_xticks(list(positions), [f"run {run['run']}" for run in runs])
    axes.set_ylabel("wall seconds")
    problems = ", ".join(f"{name} ({count})" for name, count in result["candidates"].items())
    axes.set_title(f"Tuning {problems} candidates, {result.get('device', '')}", fontsize=8)
    axes.legend(fontsize=7)
    return [_save(figure, out / "tuning-wall.png", plt)]


def _save(figure: Any, path: Path, plt: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")  # long labels stay in
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    """Make the figures of result files again: ``python -m accy_bench.plots FILE... --out DIR``."""
    parser = argparse.ArgumentParser(prog="python -m accy_bench.plots", description=__doc__)
    parser.add_argument("results", nargs="+", help="bench.json or workload.json files")
    parser.add_argument("--out", default=".", help="folder for the PNG files")
    args = parser.parse_args(argv)
    if not available():
        print("the figures need matplotlib: pip install 'accy-async[plots]'", file=sys.stderr)
        return 2
    for name in args.results:
        result = json.loads(Path(name).read_text())
        plot = (
            plot_workload
            if "completion" in result
            else plot_kernels
            if "rows" in result
            else plot_tuning
            if "runs" in result
            else plot_bench
        )
        for path in plot(result, Path(args.out)):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
