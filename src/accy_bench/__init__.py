"""``accy-async bench``: launch cost and completion latency on the GPU, beside their anchors.

Everything is measured in one run, on one device, so ratios are meaningful:

* **launch cost**, host microseconds per kernel launch: raw ``cuLaunchKernel``
  with a pre-packed ``void*`` array (the anchor) and with a ``(values, types)``
  tuple; cuda.core, CuPy and PyTorch when they are installed; accy-async's
  ``backend.launch``, one stage of ``await launch_pipeline`` (pool and
  intermediates given) and one node of ``launch_graph``;
* **completion latency**, microseconds from a kernel's end (its last
  ``%globaltimer`` reading, written to mapped host memory) until the awaiting
  code runs, for 100 µs and 2 ms kernels: blocking ``cuEventSynchronize``,
  polling loops, a Python host-function callback, ``to_thread``, and
  accy-async's ``wait_event`` on asyncio, uvloop and trio with each reactor;
  with the worst lag of a 1 ms heartbeat and the process CPU used per second
  of waiting.

The GPU and host clocks are related by timing, from the host, how long a
kernel's stamp takes to appear in mapped memory (its minimum is taken as the
offset), so the latencies include no launch time.
"""

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import anyio

from .latency import run_latency
from .launch import launch_accy, launch_anchors
from .provenance import describe_run
from .rig import Rig

__all__ = ["Rig", "main", "markdown", "run_benchmarks"]


def run_benchmarks(
    repeat: int = 20,
    trials_short: int = 200,
    trials_long: int = 60,
    libraries: tuple[str, ...] = ("asyncio", "uvloop", "trio"),
) -> dict[str, Any]:
    """Run every measurement; return the results as plain data."""
    rig = Rig()
    try:
        result: dict[str, Any] = {**describe_run(rig), "clock_offset_ns": rig.calibrate()}
        result["launch_us"] = launch_anchors(rig, repeat)
        result["launch_us"].update(anyio.run(launch_accy, repeat))
        result["latency"] = {}
        # The anchors imported torch and CuPy: hundreds of thousands of objects a full
        # collection would walk, pausing the loop for milliseconds. A long-running service
        # freezes what it loaded at start-up; so does this run, so that the heartbeat
        # measures the waiting rather than a collection of the anchors' modules.
        gc.collect()
        gc.freeze()
        for label, spin_ns, trials in (
            ("100us", 100_000, trials_short),
            ("2ms", 2_000_000, trials_long),
        ):
            rows: dict[str, Any] = {}
            for library in libraries:
                rows.update(run_latency(rig, library, spin_ns, trials))
            result["latency"][label] = rows
        return result
    finally:
        rig.close()


def markdown(result: dict[str, Any]) -> str:
    """The results as Markdown tables."""
    anchor = result["launch_us"].get("cuLaunchKernel, pre-packed void* array")
    lines = [
        f"# accy-async on {result['device']}",
        "",
        f"{result['date']}; commit {result['git']['commit']}"
        + (" (with uncommitted changes)" if result["git"]["dirty"] else "")
        + f"; Python {result['python']}; "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        "",
        "## Launch cost (host µs per launch, median of batches of 256)",
        "",
        "| what | µs | x pre-packed cuLaunchKernel |",
        "|---|---|---|",
    ]
    for name, value in result["launch_us"].items():
        if isinstance(value, dict):  # accy-async, timed interleaved with its own raw launch
            lines.append(
                f"| {name} | {value['us']:.2f} | {value['us'] / value['raw_us']:.2f} "
                f"(raw {value['raw_us']:.2f} interleaved) |"
            )
        elif isinstance(value, float) and anchor:
            lines.append(f"| {name} | {value:.2f} | {value / anchor:.2f} |")
        else:
            lines.append(f"| {name} | {value} | |")
    for label, rows in result["latency"].items():
        lines += [
            "",
            f"## Completion latency, {label} kernel (µs from the kernel's end until the "
            "waiter runs)",
            "",
            "A task ticks every millisecond beside the waits (its worst lateness is the "
            "heartbeat lag); CPU cores are the process's CPU time over the waits' wall "
            "time, every thread counted, and per wait (launch and record included); "
            "start-up objects were frozen (`gc.freeze()`) before these trials.",
            "",
            "| way of waiting | median µs | p90 µs | worst heartbeat lag ms | CPU cores "
            "| CPU µs per wait |",
            "|---|---|---|---|---|---|",
        ]
        for name, row in rows.items():
            if row["median_us"] is None:
                lines.append(f"| {name} | | | {row['worst_heartbeat_lag_ms']:.2f} | | |")
                continue
            lines.append(
                f"| {name} | {row['median_us']:.1f} | {row['p90_us']:.1f} | "
                f"{row['worst_heartbeat_lag_ms']:.2f} | {row['cpu_cores']:.2f} | "
                f"{row.get('cpu_us_per_wait', float('nan')):.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and write ``bench.json`` and ``bench.md`` to ``--out``.

    ``accy-async bench workload ...`` runs the application workloads instead
    (:mod:`accy_bench.workload`); ``accy-async bench kernels ...`` the built-in
    kernels' device time (:mod:`accy_bench.kernels`).
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["workload"]:
        from .workload import main as workload_main

        return workload_main(arguments[1:])
    if arguments[:1] == ["kernels"]:
        from .kernels import main as kernels_main

        return kernels_main(arguments[1:])
    parser = argparse.ArgumentParser(
        prog="accy-async bench",
        description=__doc__.splitlines()[0],
        epilog="accy-async bench workload --help: the application workloads (another run); "
        "accy-async bench kernels --help: the built-in kernels' device time.",
    )
    parser.add_argument("--out", default=".", help="folder for bench.json and bench.md")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--trials-short", type=int, default=200)
    parser.add_argument("--trials-long", type=int, default=60)
    parser.add_argument("--libraries", nargs="+", default=["asyncio", "uvloop", "trio"])
    args = parser.parse_args(arguments)
    result = run_benchmarks(args.repeat, args.trials_short, args.trials_long, tuple(args.libraries))
    from . import plots  # here: `python -m accy_bench.plots` imports this package first

    plots.write_with_figures(result, markdown(result), Path(args.out), "bench", plots.plot_bench)
    return 0
