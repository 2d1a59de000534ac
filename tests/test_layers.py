"""The house's floors: every import in ``src/`` points down a layer (or within one), never up.

Read from the source with :mod:`ast`, so lazy imports inside functions count too;
imports under ``if TYPE_CHECKING:`` do not (they run only for the type checker).
The order is the one ``docs/architecture.md`` draws. ``accy_bench`` stands on top of
the house: it imports from ``accy_async`` only public names that exist (the CUDA
helper modules in its rig alone), and ``accy_async`` never imports it, but for the
``accy-async bench`` command's lazy import.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from .fresh_imports import modules_loaded

SOURCE = Path(__file__).parent.parent / "src"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_version", "_cache"),
    ("plan", "dlpack"),
    ("backends",),
    ("_loops",),
    ("waiting", "tracing"),
    (
        "_graph_cache",
        "kernels",
        "_launch_arguments",
        "_prepared_launch",
        "pipeline",
        "_pipeline_pool",
        "_pipeline_program",
        "graph",
        "_graph_schedule",
        "_graph_run",
        "_graph_enqueue",
    ),
    ("library", "trust"),
    (
        "buffers",
        "interop",
        "arrays",
        "call",
        "_call_intake",
        "_call_lane",
        "_call_replay",
        "graph_call",
        "_graph_lane",
        "_graph_spread",
    ),
    ("tuning",),
    (
        "cli",
        "cli_arguments",
        "cli_trust",
        "demo_command",
        "plan_commands",
        "ray",
        "run_command",
        "tune_command",
        "testing",
    ),
    ("__init__",),
)
"""Lowest first. A module may import from its own layer and the ones below."""


def _layer_of(module: str) -> int:
    room = module.split(".")[1] if "." in module else "__init__"
    for index, rooms in enumerate(LAYERS):
        if room in rooms:
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _runtime_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """The accy_async modules ``path`` imports at run time, with their lines."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("accy_async"):
                continue
            for alias in node.names:  # `from . import library` imports a module
                candidate = f"{target}.{alias.name}"
                as_path = SOURCE / candidate.replace(".", "/")
                if as_path.with_suffix(".py").exists() or as_path.is_dir():
                    yield candidate, node.lineno
                else:
                    yield target, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("accy_async"):
                    yield alias.name, node.lineno


PATHS = sorted((SOURCE / "accy_async").rglob("*.py"))


@pytest.mark.parametrize("path", PATHS, ids=[_module_name(path) for path in PATHS])
def test_imports_point_down_the_layers(path: Path) -> None:
    module = _module_name(path)
    own = _layer_of(module)
    upward = [
        f"line {line}: {target} (layer {_layer_of(target)}) from layer {own}"
        for target, line in _imports(path)
        if target != "accy_async" or module != "accy_async"
        if _layer_of(target) > own
    ]
    assert not upward, f"{module} imports up: " + "; ".join(upward)


def test_no_module_imports_itself_round_about() -> None:
    """No circle among the modules' run-time imports."""
    graph = {_module_name(path): {t for t, _ in _imports(path)} for path in PATHS}
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target == module or target not in graph:
                continue
            if state.get(target) == 1:
                circle = [*trail[trail.index(target) :], target] if target in trail else trail
                raise AssertionError("import circle: " + " -> ".join(circle))
            if not state.get(target):
                visit(target, [*trail, target])
        state[module] = 2

    for module in sorted(graph):
        if not state.get(module):
            visit(module, [module])


# ----- accy_bench: a package on top of the house -------------------------------------------

BENCH_PATHS = sorted((SOURCE / "accy_bench").rglob("*.py"))

BENCH_IMPORTERS: frozenset[tuple[str, str]] = frozenset({("accy_async.cli", "main")})
"""(module, function) of the one place ``accy_async`` may import ``accy_bench``: the
``accy-async bench`` command, lazily, inside :func:`accy_async.cli.main` (the command line
is the top layer; nothing else, and nothing at module level, may reach the benchmarks)."""


def _absolute_imports(path: Path) -> Iterator[tuple[str, str | None, int, str | None]]:
    """Every absolute import in ``path``, ``TYPE_CHECKING`` ones too.

    Yields (module, name imported from it or ``None`` for ``import module``, line, the
    function it sits in or ``None`` at module level).
    """
    tree = ast.parse(path.read_text())
    stack: list[tuple[ast.AST, str | None]] = [(tree, None)]
    while stack:
        node, function = stack.pop()
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                yield node.module, alias.name, node.lineno, function
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno, function
        inner = node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
        stack.extend((child, inner or function) for child in ast.iter_child_nodes(node))


RAW_DRIVER: frozenset[str] = frozenset(
    {"accy_async.backends.cuda.driver", "accy_async.backends.cuda.nvrtc"}
)
"""The CUDA backend's helper modules: for the raw anchors, through ``accy_bench.rig`` only."""


def _public_module(module: str) -> bool:
    return module.split(".")[0] == "accy_async" and not any(
        part.startswith("_") for part in module.split(".")
    )


@pytest.mark.parametrize("path", BENCH_PATHS, ids=[_module_name(path) for path in BENCH_PATHS])
def test_accy_bench_imports_from_accy_async_only_public_names_that_exist(path: Path) -> None:
    """From a public module, a name of its ``__all__`` or a public submodule; nothing else.

    The raw-driver rig (``accy_bench.rig``) alone may use the CUDA helper modules.
    """
    own = _module_name(path)
    wrong = []
    for module, name, line, _ in _absolute_imports(path):
        if module.split(".")[0] != "accy_async":
            continue
        if not _public_module(module):
            wrong.append(f"line {line}: {module} is internal")
            continue
        if module in RAW_DRIVER and own != "accy_bench.rig":
            wrong.append(f"line {line}: {module} is for the rig (accy_bench.rig) alone")
        try:
            imported = importlib.import_module(module)
        except ImportError:
            wrong.append(f"line {line}: no module {module}")
            continue
        if name is None:
            continue
        if not hasattr(imported, name):
            wrong.append(f"line {line}: {module} has no {name}")
        elif not (
            name in getattr(imported, "__all__", ())
            or (
                isinstance(getattr(imported, name), ModuleType)
                and _public_module(f"{module}.{name}")
            )
        ):
            wrong.append(f"line {line}: {name} is not in {module}.__all__")
    assert not wrong, f"{own}: " + "; ".join(wrong)


def test_accy_async_never_imports_accy_bench_but_lazily_in_the_command() -> None:
    found = {
        (_module_name(path), function)
        for path in PATHS
        for module, _, _, function in _absolute_imports(path)
        if module.split(".")[0] == "accy_bench"
    }
    assert found == BENCH_IMPORTERS, (
        "accy_async imports accy_bench only inside cli.main (the `accy-async bench` "
        f"command, lazily); found {sorted(found, key=str)}"
    )


def test_importing_all_of_accy_async_loads_no_benchmark() -> None:
    modules = [
        _module_name(path)
        for path in PATHS
        if path.stem not in ("__main__", "nvrtc_worker")  # scripts, run as processes
    ]
    assert modules_loaded(modules, ["accy_bench"]) == []
