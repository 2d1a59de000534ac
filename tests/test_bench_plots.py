"""The benchmark figures, drawn from the committed H200 results (matplotlib: the plots extra)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accy_bench import plots

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"

pytestmark = pytest.mark.skipif(not plots.available(), reason="matplotlib is not installed")


def test_the_bench_and_workload_results_become_figures(tmp_path: Path) -> None:
    bench = json.loads((RESULTS / "cuda-bench.json").read_text())
    written = plots.plot_bench(bench, tmp_path)
    assert {path.name for path in written} == {
        "launch-cost.png",
        *(f"completion-{length}.png" for length in bench["latency"]),
    }
    workload = json.loads((RESULTS / "app-workload.json").read_text())
    written += plots.plot_workload(workload, tmp_path)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_the_tuning_results_become_a_figure(tmp_path: Path) -> None:
    assert plots.main([str(RESULTS / "tuning-cuda.json"), "--out", str(tmp_path)]) == 0
    figure = tmp_path / "tuning-wall.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000


def test_the_command_redraws_committed_results(tmp_path: Path) -> None:
    assert plots.main([str(RESULTS / "cuda-bench.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "launch-cost.png").exists()
