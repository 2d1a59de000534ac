"""Every example runs to completion on the CPU backend and checks its own results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"

CASES = {
    "quickstart.py": ["--backend", "cpu", "-n", "100000"],
    "many_pipelines.py": ["--backend", "cpu", "--count", "1000"],
    "scan_service.py": ["--backend", "cpu", "--self-test", "--clients", "20"],
}


def test_every_example_is_covered() -> None:
    assert {path.name for path in EXAMPLES.glob("*.py")} == set(CASES)


@pytest.mark.parametrize(("script", "arguments"), CASES.items(), ids=list(CASES))
def test_example_runs(script: str, arguments: list[str]) -> None:
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "wrong" not in completed.stdout or " 0 wrong" in completed.stdout
