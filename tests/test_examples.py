"""Every example runs to completion on the CPU backend and checks its own results."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"

CASES = {
    "quickstart.py": ["--backend", "cpu", "-n", "100000"],
    "many_pipelines.py": ["--backend", "cpu", "--count", "1000"],
    "scan_service.py": ["--backend", "cpu", "--self-test", "--clients", "20"],
    "torch_service.py": ["--backend", "cpu", "--clients", "8", "--requests", "10"],
    "ray_service.py": ["--backend", "cpu", "--actors", "2", "--clients", "8", "--requests", "10"],
    "two_devices.py": ["--backend", "cpu", "-n", "100000", "--clients", "4", "--requests", "10"],
}
NEEDS = {"torch_service.py": "torch", "ray_service.py": "ray"}
"""Examples that need an optional library: run where it is installed (Ray is in the test extra;
PyTorch is on the GPU machine)."""


def test_every_example_is_covered() -> None:
    assert {path.name for path in EXAMPLES.glob("*.py")} == set(CASES)


@pytest.mark.parametrize(("script", "arguments"), CASES.items(), ids=list(CASES))
def test_example_runs(script: str, arguments: list[str]) -> None:
    if script in NEEDS:
        pytest.importorskip(NEEDS[script])
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "wrong" not in completed.stdout or " 0 wrong" in completed.stdout


README = Path(__file__).parent.parent / "README.md"


def readme_python_blocks() -> list[str]:
    """The README's ```python blocks, in order."""
    return [part.split("```", 1)[0] for part in README.read_text().split("```python\n")[1:]]


def test_the_readme_has_a_python_example() -> None:
    assert readme_python_blocks()


def test_readme_fragments_compile() -> None:
    """Blocks that are not whole programs (no ``anyio.run``) at least compile."""
    for block in readme_python_blocks():
        if "anyio.run(" not in block:
            compile(block, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize(
    "program", [block for block in readme_python_blocks() if "anyio.run(" in block]
)
def test_readme_program_runs_as_written(program: str) -> None:
    """Each whole program of the README, as written: on the GPU where there is one, else CPU.

    Its output must be what its comments say it prints.
    """
    completed = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    printed = [line.split("#")[-1].strip() for line in program.splitlines() if "print(" in line]
    assert completed.stdout.splitlines() == printed
