"""Several before/after rounds of ``accy-async bench`` at once: each row's change, per round.

A loan of a GPU machine drifts, and a latency median can flip between the
modes of a bimodal distribution, so one pair of runs can show a change of
±50% that the next pair reverses. This lists, per row, the change of every
round (the launch rows' ratio to the raw ``cuLaunchKernel`` measured
interleaved with them; the completion rows' median latency) and their
geometric mean, and counts the rounds in which the after run was slower::

    python benchmarks/compare_rounds.py BEFORE1.json:AFTER1.json BEFORE2.json:AFTER2.json ...
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any


def _row(name: str, ratios: list[float | None]) -> str:
    """One row: each round's change (a dash where the round lacks the row), mean, slower."""
    present = [r for r in ratios if r is not None]
    mean = math.exp(statistics.mean(math.log(r) for r in present))
    slower = sum(r > 1 for r in present)
    changes = " | ".join("-" if r is None else f"{r - 1:+.1%}" for r in ratios)
    return f"| {name} | {changes} | **{mean - 1:+.1%}** | {slower} of {len(present)} |"


def _launch_ratio(entry: Any) -> float | None:
    return entry["us"] / entry["raw_us"] if isinstance(entry, dict) else None


def compare(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """The Markdown table of every accy row over the rounds ``pairs`` (before, after)."""
    header = " | ".join(f"round {i + 1}" for i in range(len(pairs)))
    lines = [
        f"| row | {header} | geometric mean | rounds slower |",
        "|---|" + "---|" * (len(pairs) + 2),
    ]
    launch_rows = dict.fromkeys(name for _, after in pairs for name in after["launch_us"])
    for name in launch_rows:
        ratios: list[float | None] = []
        for before, after in pairs:
            old = _launch_ratio(before["launch_us"].get(name))
            new = _launch_ratio(after["launch_us"].get(name))
            ratios.append(new / old if old and new else None)
        if any(ratios) and name.startswith("accy"):
            lines.append(_row(f"launch: {name} (x raw)", ratios))
    lengths = dict.fromkeys(length for _, after in pairs for length in after["latency"])
    for length in lengths:
        waits = dict.fromkeys(
            name for _, after in pairs for name in after["latency"].get(length, {})
        )
        for name in waits:
            ratios = []
            for before, after in pairs:
                was: dict[str, Any] = before["latency"].get(length, {}).get(name) or {}
                now: dict[str, Any] = after["latency"].get(length, {}).get(name) or {}
                both = was.get("median_us") and now.get("median_us")
                ratios.append(now["median_us"] / was["median_us"] if both else None)
            if any(ratios) and name.startswith("accy"):
                lines.append(_row(f"completion {length}: {name} (median)", ratios))
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    pairs = []
    for argument in argv:
        before, _, after = argument.partition(":")
        pairs.append((json.loads(Path(before).read_text()), json.loads(Path(after).read_text())))
    if not pairs:
        print(__doc__, file=sys.stderr)
        return 2
    sys.stdout.write(compare(pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
