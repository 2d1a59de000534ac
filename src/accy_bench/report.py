"""The workloads' results as Markdown: a table per workload, rows sorted, extremes marked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, TypeAlias

__all__ = ["COMPLETION_COLUMNS", "SERVICE_COLUMNS", "markdown", "sort_rows", "table"]

Column: TypeAlias = tuple[str, str, str]
"""A table column: its heading, the row's key, the format of the value."""

_LATENCY_COLUMNS: Final[tuple[Column, ...]] = (
    ("median µs", "median_us", "{:.1f}"),
    ("p90 µs", "p90_us", "{:.1f}"),
    ("p99 µs", "p99_us", "{:.1f}"),
    ("CPU cores", "cpu_cores", "{:.2f}"),
)
COMPLETION_COLUMNS: Final[tuple[Column, ...]] = (
    ("trials", "count", "{:d}"),
    *_LATENCY_COLUMNS,
    ("CPU µs per wait", "cpu_us_per_wait", "{:.0f}"),
    ("worst heartbeat lag ms", "worst_heartbeat_lag_ms", "{:.2f}"),
    ("GC runs", "gc_pauses", "{:d}"),
    ("worst GC pause ms", "worst_gc_pause_ms", "{:.2f}"),
    ("wrong", "wrong", "{:d}"),
)
SERVICE_COLUMNS: Final[tuple[Column, ...]] = (
    ("requests", "count", "{:d}"),
    ("requests/s", "requests_per_s", "{:.0f}"),
    *_LATENCY_COLUMNS,
    ("CPU µs per request", "cpu_us_per_wait", "{:.0f}"),
    ("worst heartbeat lag ms", "worst_heartbeat_lag_ms", "{:.2f}"),
    ("GC runs", "gc_pauses", "{:d}"),
    ("worst GC pause ms", "worst_gc_pause_ms", "{:.2f}"),
    ("wrong", "wrong", "{:d}"),
)
_MARKED: Final = (("p99_us", "p99"), ("worst_heartbeat_lag_ms", "heartbeat lag"))

_COMPLETION_INTRO: Final = (
    "Microseconds from a kernel's end (its last `%globaltimer`, written to mapped host "
    "memory; the clocks related before each trial) until the awaiting task runs. CPU cores: "
    "the process's CPU time, every thread, over the waits' wall time (launch to resume). A "
    "task ticks every millisecond on the same loop; its worst lateness is the heartbeat lag. "
    "Wrong: waits that returned before the kernel's stamp landed. accy-async rows launch "
    "through the backend on its own stream; the baselines launch the rig's raw kernel and "
    "record a raw event."
)
_CANCELLATION_COLUMNS: Final[tuple[Column, ...]] = (
    ("trials", "count", "{:d}"),
    ("median µs", "median_us", "{:.1f}"),
    ("p90 µs", "p90_us", "{:.1f}"),
    ("p99 µs", "p99_us", "{:.1f}"),
    ("worst heartbeat lag ms", "worst_heartbeat_lag_ms", "{:.2f}"),
    ("not cancelled", "wrong", "{:d}"),
)
_CANCELLATION_INTRO: Final = (
    "Microseconds from cancelling the caller's scope (from another task, 5 ms into a 50 ms "
    "kernel) until the cancelled call has given control back (its cancel scope exited), "
    "beside a cancelled `anyio.sleep(1)`: the loop's and AnyIO's own share. What the device "
    "still uses goes to deferred release. The heartbeat's worst lag shows a loop held up "
    "before the cancellation arrived (the driver holds launches, records and allocations "
    "while a module loads or memory is freed behind a running kernel)."
)
_SERVICE_INTRO: Final = (
    "Each task has its own stream, scratch and output; the input (all ones) and the kernel "
    "pool are shared. A request launches the `prefix_sum_i32` pipeline, a stamp kernel, and "
    "awaits the download of the last element, which must be `n` (wrong counts those that are "
    "not). accy-async latency: from the stamp to the task resuming (the clocks related before "
    "and after each row, while the device is idle). CPU cores: process CPU time over the "
    "row's wall time."
)


def sort_rows(rows: dict[str, Any]) -> list[str]:
    """Row names, accy-async's first, then the baselines, each group in its measured order."""
    return sorted(rows, key=lambda name: not name.startswith("accy"))


def _marks(rows: dict[str, Any]) -> dict[str, list[str]]:
    """The rows with the highest and lowest p99 and heartbeat lag (where they differ)."""
    marks: dict[str, list[str]] = {}
    for key, label in _MARKED:
        values = {
            name: row[key]
            for name, row in rows.items()
            if isinstance(row, dict) and row.get(key) is not None
        }
        if len(values) < 2 or max(values.values()) == min(values.values()):
            continue
        marks.setdefault(max(values, key=values.__getitem__), []).append(f"**worst {label}**")
        marks.setdefault(min(values, key=values.__getitem__), []).append(f"best {label}")
    return marks


def _cell(value: Any, form: str) -> str:
    return "" if value is None else form.format(value)


def table(rows: dict[str, Any], columns: Sequence[Column], first: str) -> list[str]:
    """One Markdown table: a row per entry, sorted and marked; text rows say why they are empty."""
    marks = _marks(rows)
    lines = [
        f"| {first} | " + " | ".join(heading for heading, _, _ in columns) + " | notes |",
        "|---" * (len(columns) + 2) + "|",
    ]
    for name in sort_rows(rows):
        row = rows[name]
        if not isinstance(row, dict):
            lines.append(f"| {name} |" + " |" * len(columns) + f" {row} |")
            continue
        notes = [*marks.get(name, []), *([row["note"]] if row.get("note") else [])]
        cells = [_cell(row.get(key), form) for _, key, form in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'; '.join(notes)} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The results as Markdown: the set-up, then a table per workload of each section."""
    git = result["git"]
    revision = "unknown commit" if git["commit"] is None else f"commit {git['commit'][:12]}"
    if git["dirty"]:
        revision += " (with uncommitted changes)"
    lines = [
        f"# accy-async application workloads on {result['device']}",
        "",
        f"{result['date']}; {revision}; Python {result['python']}; "
        + ", ".join(f"{name} {version}" for name, version in result["versions"].items())
        + ("; **quick run**" if result["quick"] else ""),
    ]
    for key, title, intro, columns, first in (
        (
            "completion",
            "Completion latency",
            _COMPLETION_INTRO,
            COMPLETION_COLUMNS,
            "way of waiting",
        ),
        ("service", "Scan service", _SERVICE_INTRO, SERVICE_COLUMNS, "service"),
        ("cancellation", "Cancellation", _CANCELLATION_INTRO, _CANCELLATION_COLUMNS, "call"),
    ):
        if key not in result:
            continue
        lines += ["", f"## {title}", "", intro]
        for workload, rows in result[key].items():
            lines += ["", f"### {workload}", "", *table(rows, columns, first)]
    return "\n".join(lines) + "\n"
