"""benchmarks/compare_rounds.py: each round's change per row, the geometric mean, rounds slower."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "compare_rounds.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compare_rounds", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench(launch_us: float, raw_us: float, median_us: float) -> dict[str, Any]:
    return {
        "launch_us": {
            "cuLaunchKernel, pre-packed void* array": raw_us,
            "accy launch": {"us": launch_us, "raw_us": raw_us},
        },
        "latency": {
            "100us": {
                "nothing: the heartbeat alone": {"median_us": None},
                "accy wait (asyncio)": {"median_us": median_us},
            }
        },
    }


def _written(folder: Path, rounds: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """The rounds as JSON files in ``folder``: the script's BEFORE:AFTER arguments."""
    arguments = []
    for index, (before, after) in enumerate(rounds):
        paths = folder / f"before{index}.json", folder / f"after{index}.json"
        paths[0].write_text(json.dumps(before))
        paths[1].write_text(json.dumps(after))
        arguments.append(f"{paths[0]}:{paths[1]}")
    return arguments


def test_each_round_is_judged_against_its_own_raw_launch(tmp_path: Path, capsys: Any) -> None:
    rounds = [
        (_bench(10.0, 5.0, 40.0), _bench(8.0, 4.0, 50.0)),  # launch: 2.0x raw both: no change
        (_bench(10.0, 5.0, 40.0), _bench(11.0, 5.0, 20.0)),  # launch +10%, wait -50%
    ]
    assert _script().main(_written(tmp_path, rounds)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| row | round 1 | round 2 | geometric mean | rounds slower |"
    launch = next(line for line in lines if line.startswith("| launch: accy launch"))
    assert "| +0.0% | +10.0% | **+4.9%** | 1 of 2 |" in launch
    wait = next(line for line in lines if "accy wait (asyncio)" in line)
    assert "| +25.0% | -50.0% | **-20.9%** | 1 of 2 |" in wait
    assert not any("heartbeat" in line or "cuLaunchKernel" in line for line in lines)


def test_a_row_missing_from_a_round_keeps_the_other_rounds_in_their_columns(
    tmp_path: Path, capsys: Any
) -> None:
    newer = _bench(11.0, 5.0, 40.0)
    newer["launch_us"]["accy traced"] = {"us": 20.0, "raw_us": 5.0}
    rounds = [
        (_bench(10.0, 5.0, 40.0), _bench(10.0, 5.0, 40.0)),  # before the row existed
        (newer, newer),
    ]
    assert _script().main(_written(tmp_path, rounds)) == 0
    traced = next(line for line in capsys.readouterr().out.splitlines() if "accy traced" in line)
    assert traced.endswith("| - | +0.0% | **+0.0%** | 0 of 1 |")
