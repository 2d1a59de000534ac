"""The whole GPU comparison in one run: launch cost and completion latency beside the anchors.

Run on the GPU machine; writes ``bench.json`` and ``bench.md`` (default:
``benchmarks/results/``)::

    python benchmarks/cuda_bench.py --out benchmarks/results/
"""

from __future__ import annotations

import sys
from pathlib import Path

from accy_bench import main

if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--out" not in arguments:
        arguments += ["--out", str(Path(__file__).parent / "results")]
    raise SystemExit(main(arguments))
