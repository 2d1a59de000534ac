"""The application workloads on the GPU machine: completion of varied, queued and cold kernels
and a prefix-sum service, beside their baselines, on asyncio, uvloop and trio.

Writes ``workload.json`` and ``workload.md`` (default: ``benchmarks/results/``)::

    python benchmarks/app_workload.py [--quick] [--out DIR]

The same as ``accy-async bench workload``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from accy_bench.workload import main

if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--out" not in arguments:
        arguments += ["--out", str(Path(__file__).parent / "results")]
    raise SystemExit(main(arguments))
