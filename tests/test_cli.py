"""The command line: demo, run, validate and schema."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from accy_async import library
from accy_async import plan as p
from accy_async.cli import main


def test_demo_prints_a_verified_prefix_sum(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["demo", "--backend", "cpu", "-n", "100003", "--repeat", "2", "--json", "--quiet"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] is True
    assert (report["backend"], report["n"]) == ("cpu", 100_003)
    assert report["elements_per_second"] > 0


def test_demo_text_names_backend_size_time_and_throughput(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--backend", "cpu", "-n", "5000", "--repeat", "1"]) == 0
    captured = capsys.readouterr()
    assert "5,000 float32 on cpu" in captured.out
    assert "ms" in captured.out and "M elements/s" in captured.out
    assert "checked against NumPy: OK" in captured.out
    assert "run 1/1" in captured.err  # progress goes to stderr


def test_run_a_builtin_plan_writes_results(tmp_path: Path) -> None:
    assert (
        main(
            [
                "run",
                "prefix_sum_i32",
                "--scalar",
                "n=1234",
                "--out",
                str(tmp_path),
                "--backend",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    x, y = np.load(tmp_path / "x.npy"), np.load(tmp_path / "y.npy")
    np.testing.assert_array_equal(y, np.cumsum(x, dtype=np.int32))


def test_run_reads_operands_from_npy_files(tmp_path: Path) -> None:
    x = np.arange(10, dtype=np.float32)
    y = np.ones(10, dtype=np.float32)
    np.save(tmp_path / "in_x.npy", x)
    np.save(tmp_path / "in_y.npy", y)
    plan = tmp_path / "saxpy.json"
    plan.write_bytes(p.encode_json(library.saxpy()))
    assert (
        main(
            [
                "run",
                str(plan),
                "--scalar",
                "n=10",
                "--scalar",
                "a=3",
                "--operand",
                f"x={tmp_path / 'in_x.npy'}",
                "--operand",
                f"y={tmp_path / 'in_y.npy'}",
                "--out",
                str(tmp_path),
                "--backend",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), 3 * x + y)


def test_run_refuses_missing_scalars(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", "prefix_sum_f32", "--out", str(tmp_path), "--backend", "cpu"]) == 2
    assert "give the runtime scalars ['n']" in capsys.readouterr().err


def test_validate_lists_every_error_with_its_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    document = library.prefix_sum()
    registry = p.KernelCallRegistry(entries=document.registry.entries[1:])  # drop one stage
    broken = tmp_path / "broken.json"
    broken.write_bytes(
        p.encode_json(p.PipelineDocument(pipeline=document.pipeline, registry=registry))
    )
    malformed = tmp_path / "malformed.json"
    malformed.write_text('{"kind": "pipeline", "pipeline": {"target": 3}}')
    assert main(["validate", "prefix_sum_f32", str(broken), str(malformed)]) == 1
    out = capsys.readouterr().out
    assert "prefix_sum_f32: valid" in out
    assert "[cpu] no registry entry" in out
    assert "- at `$.pipeline.stages[0]`" in out
    assert "malformed.json: PlanError" in out and "$.pipeline.target" in out


def test_schema_is_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "PipelineDocument" in schema["$defs"]
    target = tmp_path / "schema.json"
    assert main(["schema", "--output", str(target)]) == 0
    assert json.loads(target.read_text()) == schema
