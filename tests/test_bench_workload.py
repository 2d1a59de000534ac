"""The application workloads' pure parts: statistics, workloads, rows, Markdown, options."""

from __future__ import annotations

import argparse
import random
import subprocess
from typing import Any

import pytest

from accy_bench.completion import (
    COMPLETION_WORKLOADS,
    completion_seconds,
    quick_workloads,
    trial_lengths,
)
from accy_bench.provenance import git_revision
from accy_bench.report import COMPLETION_COLUMNS, markdown, sort_rows, table
from accy_bench.service import (
    CUPY_NOTE,
    request_plan,
    service_max_n,
    service_workloads,
    short_number,
)
from accy_bench.stats import ClockLine, Samples, failure, log_uniform, percentile
from accy_bench.workload import parse_args, parse_size_range

from .fresh_imports import modules_loaded


def test_importing_the_benchmark_loads_no_cuda() -> None:
    assert modules_loaded(["accy_bench.workload"], ["cuda"], already=["accy_async"]) == []


@pytest.mark.parametrize(
    ("fraction", "expected"), [(0.5, 50), (0.9, 90), (0.99, 99), (1.0, 100), (0.0, 1)]
)
def test_percentile_is_nearest_rank(fraction: float, expected: float) -> None:
    values = list(range(100, 0, -1))  # unsorted on purpose
    assert percentile(values, fraction) == expected


def test_percentile_of_few_values_and_of_none() -> None:
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([1.0, 2.0, 3.0], 0.9) == 3.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)


def test_samples_summarise_a_row() -> None:
    samples = Samples()
    for latency in range(1, 101):
        samples.add(float(latency), cpu_s=0.001, wall_s=0.004)
    samples.add(None, wrong=True, cpu_s=0.001, wall_s=0.004)  # a stamp that never landed
    row = samples.summary(worst_lag_s=0.0025)
    assert row["count"] == 101
    assert row["wrong"] == 1
    assert row["median_us"] == 50.5
    assert (row["p90_us"], row["p99_us"]) == (90.0, 99.0)
    assert row["cpu_cores"] == pytest.approx(0.25)
    assert row["cpu_us_per_wait"] == pytest.approx(1000.0)
    assert row["worst_heartbeat_lag_ms"] == pytest.approx(2.5)
    assert "requests_per_s" not in row


def test_service_summary_adds_throughput() -> None:
    samples = Samples(cpu_s=0.5, wall_s=2.0)
    for latency in (10.0, 20.0, 30.0, 40.0):
        samples.add(latency)
    row = samples.service_summary(0.001)
    assert row["requests_per_s"] == pytest.approx(2.0)
    assert row["cpu_cores"] == pytest.approx(0.25)
    assert row["median_us"] == 25.0


def test_an_empty_row_has_no_latencies() -> None:
    row = Samples().summary(0.0)
    assert row["count"] == 0
    assert row["median_us"] is row["p99_us"] is row["cpu_cores"] is row["cpu_us_per_wait"] is None


def test_clock_line_interpolates_the_offset() -> None:
    line = ClockLine(start_ns=1_000, start_offset=100, end_ns=2_000, end_offset=300)
    assert line.offset_at(1_000) == 100
    assert line.offset_at(1_500) == pytest.approx(200)
    assert line.offset_at(2_000) == pytest.approx(300)
    # resumed 1500, stamped 500 GPU ns: 1000 ns apart on the clocks, less the 200 offset
    assert line.latency_us(1_500, 500) == pytest.approx(0.8)
    assert ClockLine(5, 40, 5, 90).offset_at(7) == 40.0


def test_failure_names_the_first_leaf_of_a_group() -> None:
    group = ExceptionGroup("tasks", [ExceptionGroup("inner", [KeyError("x")]), ValueError()])
    assert failure(group) == "failed: KeyError: 'x'"
    assert failure(RuntimeError("boom")) == "failed: RuntimeError: boom"


def test_log_uniform_stays_in_range_and_spreads_over_decades() -> None:
    rng = random.Random(1)
    values = [log_uniform(rng, 1_000, 1_000_000) for _ in range(2_000)]
    assert min(values) >= 1_000 and max(values) <= 1_000_000
    decades = [sum(10**k <= v < 10 ** (k + 1) for v in values) for k in (3, 4, 5)]
    assert all(500 < count < 800 for count in decades)


def test_every_method_sees_the_same_lengths() -> None:
    for workload in COMPLETION_WORKLOADS:
        first, again = trial_lengths(workload), trial_lengths(workload)
        assert first == again
        assert len(first) == workload.trials + 1  # the warm-up trial first
    by_name = {workload.name: workload for workload in COMPLETION_WORKLOADS}
    queued = trial_lengths(by_name["queued: 8 back-to-back on one stream"])
    assert all(len(lengths) == 8 for lengths in queued)
    assert all(50_000 <= ns <= 1_000_000 for lengths in queued for ns in lengths)
    bimodal = {ns for (ns,) in trial_lengths(by_name["bimodal 100 us / 3 ms"])}
    assert bimodal == {100_000, 3_000_000}
    assert trial_lengths(by_name["fixed 2 ms"])[5] == (2_000_000,)
    assert by_name["first wait on a fresh stream"].fresh_stream


def test_the_completion_section_fits_its_time() -> None:
    full = completion_seconds(COMPLETION_WORKLOADS, loops=3)
    quick = completion_seconds(quick_workloads(COMPLETION_WORKLOADS), loops=3)
    assert 15 < full < 240
    assert quick < full / 3
    assert all(q.trials >= 10 for q in quick_workloads(COMPLETION_WORKLOADS))


def test_service_sizes() -> None:
    small, varied = service_workloads((1_000, 1_000_000), (100_000, 300_000_000))
    assert small.name == "small: n log-uniform 1e3..1e6"
    assert varied.name == "varied: n log-uniform 1e5..3e8"
    quick_small, _ = service_workloads((1_000, 1_000_000), (100_000, 300_000_000), quick=True)
    assert quick_small.requests < small.requests
    assert service_max_n(300_000_000, 64) == 300_000_000  # 65 x 1.2 GB fits in 100 GB
    assert service_max_n(300_000_000, 64, budget=26 * 10**9) == 100_000_000
    plan = request_plan(varied, 64, 300_000_000)
    assert len(plan) == 64 and {len(sizes) for sizes in plan} == {varied.requests // 64}
    assert all(100_000 <= n <= 300_000_000 for sizes in plan for n in sizes)
    assert plan == request_plan(varied, 64, 300_000_000)
    assert plan[0] != plan[1]
    assert len(request_plan(small, 1, 1_000_000)[0]) == small.requests


@pytest.mark.parametrize(
    ("value", "text"), [(1_000, "1e3"), (300_000_000, "3e8"), (1_500, "1.5e3"), (7, "7e0")]
)
def test_short_numbers(value: int, text: str) -> None:
    assert short_number(value) == text
    assert parse_size_range(f"{text}..{text}") == (value, value)


def test_parse_size_range() -> None:
    assert parse_size_range("1e3..1e6") == (1_000, 1_000_000)
    assert parse_size_range("100..300000000") == (100, 300_000_000)
    for bad in ("1e6..1e3", "0..10", "1e3", "a..b", "1e3..1e10", "1..inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size_range(bad)


def test_parse_args_defaults_and_choices() -> None:
    defaults = parse_args([])
    assert defaults.libraries == ["asyncio", "uvloop", "trio"]
    assert defaults.sections == ["completion", "service", "cancellation"]
    assert (defaults.small, defaults.varied) == ((1_000, 1_000_000), (100_000, 300_000_000))
    assert defaults.tasks == [1, 64] and not defaults.quick
    chosen = parse_args(
        [
            *("--quick", "--libraries", "trio", "--sections", "service"),
            *("--varied", "1e4..2e5", "--tasks", "4", "--out", "results"),
        ]
    )
    assert chosen.quick and chosen.libraries == ["trio"] and chosen.sections == ["service"]
    assert chosen.varied == (10_000, 200_000) and chosen.tasks == [4]
    assert str(chosen.out) == "results"


@pytest.mark.parametrize(
    "argv",
    [["--libraries", "curio"], ["--sections", "launch"], ["--small", "5..1"], ["--tasks", "0"]],
)
def test_parse_args_refuses(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_git_revision_without_git(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", missing)
    assert git_revision() == {"commit": None, "dirty": None}


def _row(p99: float, lag_ms: float, **extra: Any) -> dict[str, Any]:
    row = {
        "count": 150,
        "median_us": p99 / 2,
        "p90_us": p99 * 0.8,
        "p99_us": p99,
        "cpu_cores": 0.4,
        "cpu_us_per_wait": 312.4,
        "worst_heartbeat_lag_ms": lag_ms,
        "wrong": 0,
    }
    row.update(extra)
    return row


def _result() -> dict[str, Any]:
    return {
        "date": "2026-12-01 14:00:00",
        "python": "3.12.3",
        "device": "NVIDIA H200 (sm_90)",
        "versions": {"driver": "13000", "anyio": "4.16.0"},
        "git": {"commit": "0123456789abcdef0123", "dirty": True},
        "quick": True,
        "completion": {
            "fixed 100 us": {
                "poll cuEventQuery + yield (the floor, burns a core) (asyncio)": _row(9.0, 0.3),
                "to_thread(cuEventSynchronize) (asyncio)": _row(180.0, 0.2),
                "accy wait_event, balanced (default) (asyncio)": _row(40.0, 0.9),
                "accy wait_event, policy latency (trio)": "failed: TypeError: nope",
            }
        },
        "service": {
            "small: n log-uniform 1e3..1e6": {
                "CuPy cumsum via to_thread, 64 tasks (asyncio)": _row(
                    21_000.0, 4.0, requests_per_s=2800.0, note=CUPY_NOTE
                ),
                "accy launch_pipeline + download, 64 tasks (asyncio)": _row(
                    900.0, 1.0, requests_per_s=30_000.0
                ),
            }
        },
    }


def test_rows_sort_accy_first_keeping_order() -> None:
    rows = _result()["completion"]["fixed 100 us"]
    assert sort_rows(rows) == [
        "accy wait_event, balanced (default) (asyncio)",
        "accy wait_event, policy latency (trio)",
        "poll cuEventQuery + yield (the floor, burns a core) (asyncio)",
        "to_thread(cuEventSynchronize) (asyncio)",
    ]


def test_markdown_tables() -> None:
    text = markdown(_result())
    lines = text.splitlines()
    assert lines[0] == "# accy-async application workloads on NVIDIA H200 (sm_90)"
    assert "commit 0123456789ab (with uncommitted changes)" in text
    assert "**quick run**" in text
    assert "## Completion latency" in text and "## Scan service" in text
    assert "### fixed 100 us" in text and "### small: n log-uniform 1e3..1e6" in text
    header = next(line for line in lines if line.startswith("| way of waiting |"))
    assert header.count("|") == len(COMPLETION_COLUMNS) + 3
    table = [line for line in lines if line.startswith("| ") and "(asyncio)" in line]
    assert table[0].startswith("| accy wait_event, balanced (default) (asyncio) | 150 | 20.0 |")
    floor = next(line for line in lines if line.startswith("| poll cuEventQuery"))
    thread = next(line for line in lines if line.startswith("| to_thread"))
    accy = table[0]
    assert "best p99" in floor and "**worst p99**" in thread
    assert "**worst heartbeat lag**" in accy and "best heartbeat lag" in thread
    failed = next(line for line in lines if "policy latency" in line)
    assert failed.endswith("failed: TypeError: nope |")
    assert failed.count("|") == header.count("|")
    cupy = next(line for line in lines if line.startswith("| CuPy"))
    assert "| 2800 |" in cupy and CUPY_NOTE in cupy and "**worst p99**" in cupy
    service = [line for line in lines if line.startswith("| accy launch_pipeline")]
    assert service[0].startswith("| accy launch_pipeline + download, 64 tasks (asyncio) | 150 |")
    assert lines.index(service[0]) < lines.index(cupy)


def test_markdown_of_one_section_and_a_clean_tree() -> None:
    result = _result()
    del result["service"]
    result["git"] = {"commit": None, "dirty": None}
    result["quick"] = False
    text = markdown(result)
    assert "unknown commit;" in text and "quick" not in text
    assert "## Scan service" not in text


def test_marks_need_two_different_values() -> None:
    rows = {"accy a": _row(10.0, 1.0), "b": _row(10.0, 1.0), "c": "unavailable: no CuPy"}
    text = "\n".join(table(rows, COMPLETION_COLUMNS, "way of waiting"))
    assert "**worst" not in text and "best " not in text
    assert "| c |" + " |" * len(COMPLETION_COLUMNS) + " unavailable: no CuPy |" in text
