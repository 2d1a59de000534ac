"""The kernel benchmark's report, from the committed H200 results (no GPU needed here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accy_bench import kernels, plots

from .fresh_imports import modules_loaded

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def test_importing_the_kernel_bench_loads_neither_torch_nor_cuda() -> None:
    libraries = ["cuda", "torch", "cupy"]
    assert modules_loaded(["accy_bench.kernels"], libraries, already=["accy_async"]) == []


def test_the_report_has_a_table_per_kernel_and_every_result_checked() -> None:
    result = json.loads((RESULTS / "kernels.json").read_text())
    text = kernels.markdown(result)
    for kernel in ("scan i32", "scan f32", "sum f32", "saxpy f32"):
        assert f"## {kernel} (" in text
    ours = [row for row in result["rows"] if row["implementation"].startswith("accy")]
    assert ours and all(row["checked"] is True for row in ours)
    sizes = {row["n"] for row in result["rows"]}
    assert min(sizes) == 10**3 and max(sizes) == 10**9
    assert result["git"]["commit"] in text


@pytest.mark.skipif(not plots.available(), reason="matplotlib is not installed")
def test_the_kernel_results_become_a_figure(tmp_path: Path) -> None:
    assert plots.main([str(RESULTS / "kernels.json"), "--out", str(tmp_path)]) == 0
    figure = tmp_path / "kernels-bandwidth.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
