"""Two ``accy-async bench`` results side by side: did a change make the hot paths slower?

Launch rows compare each accy row's ratio to the raw ``cuLaunchKernel`` measured
interleaved with it (the machine's speed drifts between runs; the ratio does
not), completion rows the median and p90 latency and the CPU cores per wait::

    python benchmarks/compare_bench.py BEFORE.json AFTER.json > before-after.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _launch_rows(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    rows = [
        "| launch path | before µs | before x raw | after µs | after x raw | change of x raw |",
        "|---|---|---|---|---|---|",
    ]
    for name, new in after["launch_us"].items():
        old = before["launch_us"].get(name)
        if not isinstance(new, dict) or not isinstance(old, dict):
            continue
        old_ratio = old["us"] / old["raw_us"]
        new_ratio = new["us"] / new["raw_us"]
        rows.append(
            f"| {name} | {old['us']:.2f} | {old_ratio:.2f} | {new['us']:.2f} | {new_ratio:.2f} "
            f"| {100 * (new_ratio / old_ratio - 1):+.1f}% |"
        )
    return rows


def _latency_rows(before: dict[str, Any], after: dict[str, Any], length: str) -> list[str]:
    rows = [
        f"| way of waiting ({length} kernel) | before median µs | after median µs "
        "| before p90 µs | after p90 µs | before cores | after cores |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, new in after["latency"].get(length, {}).items():
        old = before["latency"].get(length, {}).get(name)
        if not name.startswith("accy") or old is None or new["median_us"] is None:
            continue
        rows.append(
            f"| {name} | {old['median_us']:.1f} | {new['median_us']:.1f} | {old['p90_us']:.1f} "
            f"| {new['p90_us']:.1f} | {old['cpu_cores']:.2f} | {new['cpu_cores']:.2f} |"
        )
    return rows


def compare(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The markdown report of ``before`` against ``after`` (two bench JSON documents)."""
    lines = [
        f"# Hot paths before and after, on {after.get('device', '?')}",
        "",
        f"before: commit {before['git']['commit']}; after: commit {after['git']['commit']}; "
        "same machine, one after the other in one session.",
        "",
        "## Launch cost",
        "",
        *_launch_rows(before, after),
    ]
    for length in after["latency"]:
        lines += [
            "",
            f"## Completion latency, {length} kernel",
            "",
            *_latency_rows(before, after, length),
        ]
    return "\n".join(lines) + "\n"


def main(arguments: list[str]) -> int:
    if len(arguments) != 2:
        print("usage: compare_bench.py BEFORE.json AFTER.json", file=sys.stderr)
        return 2
    before, after = (json.loads(Path(path).read_text()) for path in arguments)
    sys.stdout.write(compare(before, after))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
