"""Concurrent tuning against the classic compile-then-measure loop, same candidates, same run.

Three kernels with 10-12 candidates each (``--kernels bench``: SGEMM,
convolution and partial_sum from ``tuning_kernels.py``; ``--kernels builtin``:
the library's saxpy, partial_sum and block_scan) are tuned on the default
backend two ways, ``--runs`` times:

* ``concurrent``: ``Tuner.tune_all`` -- the three problems as concurrent
  tasks, every candidate compiled in a worker pool while others are measured,
  measurement exclusive on the device;
* ``sequential``: ``Tuner(concurrent=False)`` -- Kernel Tuner's way: compile a
  candidate, measure it, then the next; the problems one after another.

Both use the same measurement (device events, warm-up, adaptive samples,
median) and no tuning cache; each way of each run adds a fresh empty kernel
to the sources, so no compilation is answered from a cache (NVRTC's, or
accy-async's in-process one), and both ways' compilers are started once
before the runs (reported). Reported: wall time per
way and run, their ratio, each problem's winner per way and run, and whether
winners agree across ways and runs. Writes ``results/tuning-<backend>.json``
and ``.md``. Usage::

    python benchmarks/tuning_bench.py [--backend auto] [--runs 3] [-n 16777216]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.plan import ArtifactFormat, KernelTuningProblem
from accy_async.tuning import Tuner, TuningResult

sys.path.insert(0, str(Path(__file__).parent))
import tuning_kernels  # the benchmark's own kernels, beside this file

RESULTS = Path(__file__).parent / "results"


def salted(problem: KernelTuningProblem, salt: str) -> KernelTuningProblem:
    """The problem with one more (empty) kernel in its source, so every candidate compiles
    afresh: a define alone is not enough, NVRTC answers a recompilation that differs only in
    an unused define from a cache (measured: 130 ms first, 12 ms after)."""
    source = problem.artifact.payload
    if not isinstance(source, p.TextPayload):
        return problem  # CPU kernels are not compiled
    text = f'{source.text}\nextern "C" __global__ void accy_tune_salt_{salt}() {{}}\n'
    artifact = msgspec.structs.replace(problem.artifact, payload=p.TextPayload(text))
    return msgspec.structs.replace(problem, artifact=artifact)


async def warm_compilers(backend: accy.Backend) -> dict[str, float]:
    """Start both ways' compilers once, as a long-lived process would have: NVRTC in this
    process (the sequential way) and the pool of NVRTC processes (the concurrent way).

    Returns how long each took; these one-off costs are reported, not hidden.
    """
    from accy_async.backends.cuda.compile_pool import shared_compile_pool
    from accy_async.backends.cuda.nvrtc import compile_source

    source = 'extern "C" __global__ void warm(float* x) { x[0] = 1.0f; }'
    capability = getattr(backend, "compute_capability", (9, 0))
    started = time.perf_counter()
    await anyio.to_thread.run_sync(compile_source, source, "warm", ("-DIN=1",), capability)
    in_process = time.perf_counter() - started
    started = time.perf_counter()
    workers = os.cpu_count() or 1
    pool = shared_compile_pool(workers)
    async with anyio.create_task_group() as group:
        for index in range(2 * workers):  # every worker started and through its first kernel
            group.start_soon(pool.compile, source, "warm", (f"-DW={index}",), capability)
    return {"in_process_nvrtc": in_process, "compile_pool": time.perf_counter() - started}


async def tune_once(
    backend: accy.Backend, problems: list[KernelTuningProblem], concurrent: bool
) -> tuple[float, list[TuningResult]]:
    started = time.perf_counter()
    async with Tuner(backend, concurrent=concurrent) as tuner:
        results = await tuner.tune_all(problems)
    return time.perf_counter() - started, results


def summary(result: TuningResult) -> dict[str, Any]:
    best = result.best
    return {
        "winner": result.winner,
        "winner_label": best.label if best else None,
        "winner_median_us": best.median_seconds * 1e6 if best else None,
        "compile_seconds": sum(c.compile_seconds for c in result.candidates),
        "measure_seconds": sum(c.measure_seconds for c in result.candidates),
        "setup_seconds": result.setup_seconds,
        "wall_seconds": result.wall_seconds,
        "failed": [c.index for c in result.candidates if c.status != "ok"],
        "medians_us": [round(c.median_seconds * 1e6, 3) for c in result.candidates],
        "samples": [c.samples for c in result.candidates],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    async with accy.open_backend(args.backend) as backend:
        fmt = (
            ArtifactFormat.CUDA_SOURCE
            if ArtifactFormat.CUDA_SOURCE in backend.formats
            else ArtifactFormat.CPU
        )
        if args.kernels == "bench":
            base = tuning_kernels.problems()
        else:
            base = list(library.tuning_document(fmt, args.n).kernels)
        warm = await warm_compilers(backend) if fmt is ArtifactFormat.CUDA_SOURCE else {}
        runs = []
        for run in range(args.runs):
            row: dict[str, Any] = {"run": run + 1}
            # Alternate which way goes first so neither always gets a warm device.
            order = [True, False] if run % 2 == 0 else [False, True]
            for concurrent in order:
                way = "concurrent" if concurrent else "sequential"
                salt = f"{run}{way[0]}{time.time_ns()}"
                problems = [salted(problem, salt) for problem in base]
                wall, results = await tune_once(backend, problems, concurrent)
                row[way] = {
                    "wall_seconds": wall,
                    "problems": {r.problem: summary(r) for r in results},
                }
                print(f"run {run + 1} {way}: {wall:.3f} s", file=sys.stderr, flush=True)
            row["ratio"] = row["concurrent"]["wall_seconds"] / row["sequential"]["wall_seconds"]
            row["same_winners"] = all(
                row["concurrent"]["problems"][name]["winner"]
                == row["sequential"]["problems"][name]["winner"]
                for name in row["concurrent"]["problems"]
            )
            runs.append(row)
        names = [p.name for p in base]
        winners = {
            name: sorted(
                {
                    r[way]["problems"][name]["winner"]
                    for r in runs
                    for way in ("concurrent", "sequential")
                }
            )
            for name in names
        }
        checks = {}
        if args.kernels == "bench":
            sgemm = base[0]
            for way in ("concurrent", "sequential"):
                winner = runs[0][way]["problems"]["sgemm"]["winner"]
                if winner is not None:
                    checks[way] = await tuning_kernels.check_sgemm(backend, sgemm, winner)
        return {
            "compiler_start_seconds": warm,
            "sgemm_winner_max_error": checks,
            "device": backend.name,
            "identity": msgspec.to_builtins(backend.identity),
            "python": platform.python_version(),
            "accy_async": accy.__version__ if hasattr(accy, "__version__") else "dev",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "n": args.n,
            "candidates": {p.name: len(p.candidates) for p in base},
            "runs": runs,
            "ratio_median": statistics.median(r["ratio"] for r in runs),
            "ratio_max": max(r["ratio"] for r in runs),
            "same_winners_every_run": all(r["same_winners"] for r in runs),
            "winners_across_runs": winners,
            "winners_stable": all(len(v) == 1 for v in winners.values()),
            "backend": backend.kind,
        }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Concurrent tuning vs compile-then-measure ({report['backend']}, {report['device']})",
        "",
        f"{report['date']}; n = {report['n']:,}; candidates: "
        + ", ".join(f"{k} {v}" for k, v in report["candidates"].items())
        + f"; identity {report['identity']}",
        "",
        "| run | concurrent s | sequential s | ratio | same winners |",
        "|---|---|---|---|---|",
    ]
    lines.extend(
        f"| {row['run']} | {row['concurrent']['wall_seconds']:.3f} | "
        f"{row['sequential']['wall_seconds']:.3f} | {row['ratio']:.3f} | "
        f"{'yes' if row['same_winners'] else 'NO'} |"
        for row in report["runs"]
    )
    lines += [
        "",
        "Per problem, run 1 (seconds; compile and measure are sums over candidates, so"
        " concurrent compiles overlap):",
        "",
        "| problem | way | setup | compile | measure | wall |",
        "|---|---|---|---|---|---|",
    ]
    first_run = report["runs"][0]
    for way in ("concurrent", "sequential"):
        for name, row in first_run[way]["problems"].items():
            lines.append(
                f"| {name} | {way} | {row['setup_seconds']:.3f} | {row['compile_seconds']:.3f} | "
                f"{row['measure_seconds']:.3f} | {row['wall_seconds']:.3f} |"
            )
    lines += [
        "",
        f"SGEMM winner checked against NumPy (largest error): {report['sgemm_winner_max_error']}",
        f"Compilers started once before the runs (seconds, not in the walls above): "
        f"{report['compiler_start_seconds']}",
        "",
        f"Median ratio {report['ratio_median']:.3f}, worst {report['ratio_max']:.3f} "
        "(target at most 0.6).",
        f"Same winners both ways in every run: {report['same_winners_every_run']}; "
        f"winners stable across runs: {report['winners_stable']}.",
        "",
        "| problem | winner (every run, both ways) | label | median us (run 1, concurrent) |",
        "|---|---|---|---|",
    ]
    first = report["runs"][0]["concurrent"]["problems"]
    for name, winners in report["winners_across_runs"].items():
        median = first[name]["winner_median_us"]
        shown = "-" if median is None else f"{median:.2f}"  # nothing measured (no candidate ran)
        lines.append(f"| {name} | {winners} | {first[name]['winner_label']} | {shown} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("-n", type=int, default=library.DEFAULT_TUNING_N)
    parser.add_argument("--kernels", choices=("bench", "builtin"), default="bench")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = anyio.run(main_async, args)
    from accy_bench import plots

    stem = f"tuning-{report['backend']}"
    plots.write_with_figures(report, markdown(report), args.out, stem, plots.plot_tuning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
