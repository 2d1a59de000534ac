"""The command line: demo, run, validate and schema."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

import accy_async
from accy_async import library
from accy_async import plan as p
from accy_async.backends.cpu import host_memory_available
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


def test_demo_reports_its_bandwidth_and_traces_its_last_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "demo.json"
    arguments = ["demo", "--backend", "cpu", "-n", "20000", "--repeat", "2", "--quiet"]
    assert main([*arguments, "--json", "--trace", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gigabytes_per_second"] == pytest.approx(8 * 20_000 / report["best_ms"] / 1e6)
    assert report["device_peak_gigabytes_per_second"] is None  # the CPU does not say
    events = json.loads(path.read_text())["traceEvents"]
    ran = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == 2]
    # the same request relaunched: one device graph of the scan's two stages each time
    assert ran and all(name.startswith("graph") and "of 2 nodes" in name for name in ran)
    assert main([*arguments]) == 0
    assert "GB/s" in capsys.readouterr().out


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


def test_trace_runs_a_plan_and_writes_a_timeline_of_its_stages(tmp_path: Path) -> None:
    trace = tmp_path / "scan.json"
    arguments = ["prefix_sum_i32", "--scalar", "n=5000", "--backend", "cpu", "--quiet"]
    out = ["--out", str(tmp_path / "out")]
    assert main(["trace", *arguments, *out, "-o", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    stages = [e for e in events if e["ph"] == "X" and e["pid"] == 2 and e["cat"] == "launch"]
    assert [e["name"] for e in stages] == ["scan_init", "scan_tiles"]  # as they ran
    assert sorted(e["ts"] for e in stages) == [e["ts"] for e in stages]
    assert main(["run", *arguments, *out, "--force"]) == 0  # run writes no trace
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "scan.json"]
    host_only = tmp_path / "host.json"
    assert main(["trace", *arguments, *out, "--force", "--host-only", "-o", str(host_only)]) == 0
    events = json.loads(host_only.read_text())["traceEvents"]
    launches = [e for e in events if e["ph"] == "X" and e["cat"] == "launch"]
    assert [e["name"] for e in launches] == ["launch scan_init", "launch scan_tiles"]
    assert all(e["pid"] == 1 for e in launches)  # the host's spans; no device times


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


def test_validate_checks_sizes_and_registrations_as_run_would(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    document = library.prefix_sum()
    huge = p.PipelineIntermediate(dtype=p.DType.F32, extent=p.Fixed(2**60))
    entries = list(document.registry.entries)
    cpu_index = next(i for i, e in enumerate(entries) if e.format is p.ArtifactFormat.CPU)
    entries[cpu_index] = msgspec.structs.replace(
        entries[cpu_index], payload=p.CpuKernelPayload("nobody.registered.this")
    )
    plan = tmp_path / "plan.json"
    plan.write_bytes(
        p.encode_json(
            p.PipelineDocument(
                pipeline=msgspec.structs.replace(
                    document.pipeline, intermediates=(huge, *document.pipeline.intermediates[1:])
                ),
                registry=p.KernelCallRegistry(entries=tuple(entries)),
            )
        )
    )
    assert main(["validate", str(plan)]) == 1
    out = capsys.readouterr().out
    assert "LimitExceeded: intermediate 0 needs" in out
    assert "$.pipeline.intermediates[0].extent" in out
    assert "'nobody.registered.this' is not registered" in out
    assert f"$.registry.entries[{cpu_index}].payload.name" in out


def test_schema_is_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "PipelineDocument" in schema["$defs"]
    target = tmp_path / "schema.json"
    assert main(["schema", "--output", str(target)]) == 0
    assert json.loads(target.read_text()) == schema


def _cuda_usable() -> bool:
    from accy_async.backends.cuda.driver import probe_cuda

    return probe_cuda()[0]


NO_GPU = pytest.mark.skipif(_cuda_usable(), reason="the machine has a usable GPU")

# Every mistake: (arguments, what the one-line message names). Run in a folder holding
# f64.npy (1,000 float64), flat.npy (1,000 float32), 2d.npy ((10, 100) float32),
# notnpy.npy (text) and a folder named folder.
MISTAKES = [
    pytest.param(["demo", "-n", "-5"], "-n", id="demo -n -5"),
    pytest.param(["demo", "-n", "abc"], "-n", id="demo -n abc"),
    pytest.param(["demo", "--repeat", "0"], "--repeat", id="demo --repeat 0"),
    pytest.param(["demo", "--backend", "cuda"], "NVIDIA", id="demo on cuda", marks=NO_GPU),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=10", "--backend", "cuda"],
        "NVIDIA",
        id="run on cuda",
        marks=NO_GPU,
    ),
    pytest.param(["tune", "--backend", "cuda"], "NVIDIA", id="tune on cuda", marks=NO_GPU),
    pytest.param(["bench"], "NVIDIA", id="bench", marks=NO_GPU),
    pytest.param(["run", "prefix_sum_f32", "--scalar", "n=abc"], "--scalar n", id="scalar abc"),
    pytest.param(["run", "prefix_sum_f32"], "--scalar", id="scalar missing"),
    pytest.param(["run", "prefix_sum_f32", "--scalar", "m=3"], "'m'", id="scalar unknown"),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=1000", "--operand", "x=missing.npy"],
        "missing.npy",
        id="operand file missing",
    ),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=1000", "--operand", "x"],
        "NAME=FILE.npy",
        id="operand without =",
    ),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=1000", "--operand", "x=folder"],
        "folder",
        id="operand a folder",
    ),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=1000", "--operand", "z=flat.npy"],
        "no operand 'z'",
        id="operand misspelled",
    ),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=1000", "--operand", "x=f64.npy"],
        "float64",
        id="operand dtype",
    ),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=1000", "--operand", "x=2d.npy"],
        "(10, 100)",
        id="operand 2-d",
    ),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=1000", "--operand", "x=notnpy.npy"],
        "not a .npy",
        id="operand not npy",
    ),
    pytest.param(
        ["run", "prefix_sum_i32", "--scalar", "n=1000", "--operand", "x=flat.npy"],
        "int32",
        id="float operand into an i32 plan",
    ),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=4294967295"],  # 100 GB of arrays
        "host memory",
        id="more memory than the machine has",
        marks=pytest.mark.skipif(
            (host_memory_available() or 0) > 90e9, reason="the machine has over 90 GB free"
        ),
    ),
    pytest.param(["run", "prefix_sum_f32", "--scalar", "n=-3"], "--scalar n", id="scalar < 0"),
    pytest.param(
        ["run", "prefix_sum_f32", "--scalar", "n=4294967296"], "--scalar n", id="scalar > u32"
    ),
    pytest.param(["run", "folder", "--scalar", "n=3"], "folder", id="run a folder"),
    pytest.param(["run", "nothing_here"], "neither a file", id="run an unknown plan"),
    pytest.param(["tune", "nothing_here"], "neither a file", id="tune an unknown name"),
    pytest.param(["tune", "folder"], "folder", id="tune a folder"),
    pytest.param(["tune", "-n", "0"], "-n", id="tune -n 0"),
    pytest.param(["tune", "--budget", "0"], "--budget", id="tune --budget 0"),
    pytest.param(["tune", "--budget", "-1"], "--budget", id="tune --budget -1"),
    pytest.param(
        ["schema", "--output", "/nonexistent/folder/x.json"], "--output", id="schema output"
    ),
]


@pytest.mark.parametrize(("arguments", "named"), MISTAKES)
def test_a_mistake_is_one_line_naming_it_with_status_2(
    arguments: list[str],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    np.save("f64.npy", np.zeros(1000))
    np.save("flat.npy", np.zeros(1000, dtype=np.float32))
    np.save("2d.npy", np.zeros((10, 100), dtype=np.float32))
    Path("notnpy.npy").write_text("not an array")
    Path("folder").mkdir()
    before = sorted(path.name for path in tmp_path.iterdir())
    try:
        status = main([*arguments, *(["--backend", "cpu"] if _wants_cpu(arguments) else [])])
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert status == 2, captured
    lines = captured.err.strip().splitlines()
    assert lines and named in lines[-1], captured.err
    assert "Traceback" not in captured.err
    assert sorted(path.name for path in tmp_path.iterdir()) == before  # nothing written


def _wants_cpu(arguments: list[str]) -> bool:
    """Run and tune mistakes that are not about the backend run on the CPU (quick, anywhere)."""
    return arguments[0] in ("run", "tune") and "--backend" not in arguments


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"accy-async {accy_async.__version__}"


def test_run_never_overwrites_without_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    common = ["run", "prefix_sum_f32", "--scalar", "n=100", "--backend", "cpu", "--quiet"]
    assert main(common) == 0
    assert main(common) == 0  # a second run goes to a fresh folder
    assert sorted(path.name for path in tmp_path.iterdir()) == ["accy-run-1", "accy-run-2"]
    assert sorted(path.name for path in (tmp_path / "accy-run-1").iterdir()) == ["x.npy", "y.npy"]
    assert main([*common, "--out", "accy-run-1"]) == 2
    assert main([*common, "--out", "accy-run-1", "--force"]) == 0


def test_every_option_has_help() -> None:
    from accy_async.cli import parser

    top = parser()
    commands = next(
        action for action in top._actions if isinstance(action, argparse._SubParsersAction)
    )
    for name, command in commands.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or name == "bench":
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            assert "``" not in action.help
    assert "``" not in (top.description or "")


def test_validate_reports_every_file_and_reads_msgpack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    packed = tmp_path / "plan.msgpack"
    packed.write_bytes(p.encode_msgpack(library.load_builtin("saxpy_f32")))
    status = main(["validate", str(tmp_path), str(tmp_path / "missing.json"), str(packed)])
    out = capsys.readouterr().out.splitlines()
    assert status == 1
    assert [line.split(":")[0] for line in out] == [
        str(tmp_path),
        str(tmp_path / "missing.json"),
        str(packed),
    ]
    assert out[0].endswith("is a folder; give a plan file")
    assert out[2].endswith("valid")
