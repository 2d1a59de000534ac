"""Application workloads on the GPU: accy-async beside its baselines, in one run.

``python -m accy_bench.workload --out DIR`` (or ``accy-async bench workload``)
writes ``workload.json`` and ``workload.md``. Three sections, each a module:

* **completion** (:mod:`.completion`): microseconds from a kernel's end (its
  last ``%globaltimer`` reading, written to host-mapped memory) until the
  awaiting task runs, for kernels whose lengths are fixed, random, bimodal,
  queued eight deep, or launched on a stream created for the trial.
  accy-async's waits (each wait policy, ``wait_stream``, and the completion
  reactor alone) beside polling from the loop and ``to_thread(cuEventSynchronize)``;
* **service** (:mod:`.service`): a prefix-sum service. 1 or 64 tasks on one loop
  each launch the built-in ``prefix_sum_i32`` pipeline on their own stream and
  read the last element back (it must equal ``n``); beside CuPy's ``cumsum`` in
  worker threads;
* **cancellation** (:mod:`.cancellation`): how soon each way of waiting gives
  control back when its caller is cancelled.

Every row runs on asyncio, uvloop and trio, with the worst lag of a 1 ms
heartbeat on the same loop and the process CPU time (every thread) per second
of waiting. Random lengths and sizes come from seeded generators, so every
method sees the same sequence. The rows' statistics are in :mod:`.stats`, the
device stamps in :mod:`.stamps`, the Markdown in :mod:`.report`; this module
runs the sections and is the command line.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from . import plots
from .cancellation import cancellation_section
from .completion import (
    COMPLETION_WORKLOADS,
    completion_seconds,
    completion_section,
    quick_workloads,
)
from .provenance import describe_run
from .report import markdown
from .rig import Rig
from .service import optional_cupy, service_section, service_workloads

__all__ = [
    "LIBRARIES",
    "SECTIONS",
    "main",
    "parse_args",
    "parse_size_range",
    "run_workload",
]

LIBRARIES: Final = ("asyncio", "uvloop", "trio")
SECTIONS: Final = ("completion", "service", "cancellation")


# ----- the run -------------------------------------------------------------------------------


def run_workload(
    *,
    quick: bool = False,
    libraries: Sequence[str] = LIBRARIES,
    sections: Sequence[str] = SECTIONS,
    small: tuple[int, int] = (1_000, 1_000_000),
    varied: tuple[int, int] = (100_000, 300_000_000),
    tasks: Sequence[int] = (1, 64),
) -> dict[str, Any]:
    """Run the chosen sections on each library; return the results as plain data."""
    completion = quick_workloads(COMPLETION_WORKLOADS) if quick else COMPLETION_WORKLOADS
    service = service_workloads(small, varied, quick=quick)
    rig = Rig()
    try:
        result: dict[str, Any] = {
            **describe_run(rig),
            "quick": quick,
            "libraries": list(libraries),
            "completion_trials": {workload.name: workload.trials for workload in completion},
            "service_requests": {workload.name: workload.requests for workload in service},
            "service_tasks": list(tasks),
        }
        cupy = optional_cupy() if "service" in sections else (None, "")
        # CuPy's import (and the driver's) made objects a full collection would walk, pausing
        # the loop for milliseconds; freeze them, as a long-running service would.
        gc.collect()
        gc.freeze()
        if "completion" in sections:
            result["completion"] = completion_section(rig, libraries, completion)
        if "service" in sections:
            result["service"] = service_section(rig, libraries, service, tasks, cupy)
        if "cancellation" in sections:
            result["cancellation"] = cancellation_section(libraries, 5 if quick else 20)
        return result
    finally:
        rig.close()


# ----- the command line ----------------------------------------------------------------------


def parse_size_range(text: str) -> tuple[int, int]:
    """``"1e3..1e6"`` as ``(1000, 1000000)``; sizes from 1 to 2**32 - 1, the first the smaller."""
    low_text, separator, high_text = text.partition("..")
    try:
        low, high = int(float(low_text)), int(float(high_text))
    except (ValueError, OverflowError):
        low = high = 0
    if not separator or not 1 <= low <= high <= 2**32 - 1:
        raise argparse.ArgumentTypeError(
            f"expected LOW..HIGH with 1 <= LOW <= HIGH <= 2**32 - 1 (such as 1e3..1e6), "
            f"got {text!r}"
        )
    return low, high


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's options."""
    parser = argparse.ArgumentParser(
        prog="python -m accy_bench.workload", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the results")
    parser.add_argument("--quick", action="store_true", help="a fifth of the trials and requests")
    parser.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument(
        "--small",
        type=parse_size_range,
        default=(1_000, 1_000_000),
        metavar="LOW..HIGH",
        help="sizes of the small service requests (default 1e3..1e6)",
    )
    parser.add_argument(
        "--varied",
        type=parse_size_range,
        default=(100_000, 300_000_000),
        metavar="LOW..HIGH",
        help="sizes of the varied service requests (default 1e5..3e8)",
    )
    parser.add_argument(
        "--tasks", nargs="+", type=int, default=[1, 64], help="service concurrencies"
    )
    arguments = parser.parse_args(argv)
    if min(arguments.tasks) < 1:
        parser.error("--tasks must be positive")
    return arguments


def main(argv: Sequence[str] | None = None) -> int:
    """Run the workloads and write ``workload.json`` and ``workload.md`` to ``--out``."""
    arguments = parse_args(argv)
    if "completion" in arguments.sections:
        workloads = (
            quick_workloads(COMPLETION_WORKLOADS) if arguments.quick else COMPLETION_WORKLOADS
        )
        seconds = completion_seconds(workloads, len(arguments.libraries))
        print(f"completion section: about {seconds:.0f} s", file=sys.stderr, flush=True)
    result = run_workload(
        quick=arguments.quick,
        libraries=arguments.libraries,
        sections=arguments.sections,
        small=arguments.small,
        varied=arguments.varied,
        tasks=arguments.tasks,
    )
    plots.write_with_figures(
        result, markdown(result), arguments.out, "workload", plots.plot_workload
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
