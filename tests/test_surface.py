"""The public surface: every module says what it offers, and says it truly.

As httpx's ``test_exported_members`` and anyio's ``test_all_attributes`` do: each
module's ``__all__`` is sorted (constants, classes, then functions), names only what
exists, and names every public class, function and constant the module defines (a
name other modules need but users do not is still the module's interface). A name
kept to the module starts with ``_``.
"""

from __future__ import annotations

import ast
import importlib
import typing
from pathlib import Path

import pytest

import accy_async

SOURCE = Path(__file__).parent.parent / "src"
PACKAGES = ("accy_async", "accy_bench")
"""The distribution's packages: the library, and the benchmarks built on it."""
MODULES = sorted(
    ".".join(path.relative_to(SOURCE).with_suffix("").parts).removesuffix(".__init__")
    for package in PACKAGES
    for path in (SOURCE / package).rglob("*.py")
    if path.stem not in ("__main__", "nvrtc_worker")  # scripts, run as processes
)


def _order(name: str) -> tuple[int, str]:
    """isort's order for ``__all__``: CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def _defined(module: str) -> list[str]:
    """The public classes, functions and UPPER_CASE constants ``module``'s source defines."""
    path = SOURCE / module.replace(".", "/")
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    names: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            names.extend(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper())
    return [name for name in names if not name.startswith("_")]


@pytest.mark.parametrize("name", MODULES)
def test_every_module_says_truly_what_it_offers(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert list(exported) == sorted(exported, key=_order), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ names one twice"
    missing = [each for each in exported if not hasattr(module, each)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"
    unlisted = [
        each
        for each in _defined(name)
        if each not in exported and not isinstance(getattr(module, each), typing.TypeVar)
    ]
    assert not unlisted, f"{name} defines {unlisted} outside __all__ (list them, or prefix _)"


def test_the_top_level_offers_what_an_application_needs_and_no_internals() -> None:
    offered = set(accy_async.__all__)
    for needed in (
        "open_backend",
        "open_pipeline",
        "launch_pipeline",
        "launch_graph",
        "load_kernels",
        "wait_stream",
        "wait_event",
        "ArrayView",
        "PipelineDocument",
        "TrustPolicy",
        "AccyError",
    ):
        assert needed in offered, needed
    for internal in ("Latch", "ALREADY_FIRED", "Anticipation", "Completion", "StreamMark"):
        assert internal not in offered, internal


def test_errors_are_raised_from_the_tree() -> None:
    """Every error class the package defines descends from AccyError."""
    errors = importlib.import_module("accy_async.errors")
    for each in errors.__all__:
        value = getattr(errors, each)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, errors.AccyError), each
