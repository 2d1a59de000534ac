"""The ``accy-async`` command line.

``demo``      prefix sum of N elements on the default backend, checked against NumPy
``run``       a pipeline plan file (or a built-in plan's name) on generated or .npy operands
``validate``  every error of plan files, each with its path
``schema``    the JSON Schema of plan files
``tune``      tune kernels and pipelines (the built-in ones by default), cached
``bench``     launch cost and completion latency on the GPU, beside their anchors
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import anyio

from ._version import __version__
from .cli_arguments import load_document
from .cli_trust import add_digests_parser, digests
from .demo_command import add_demo_parser, demo
from .errors import AccyError
from .plan_commands import add_schema_parser, add_validate_parser, schema, validate
from .run_command import add_run_parser, add_trace_parser, run
from .tune_command import add_tune_parser, tune

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command line's argument parser (every command but ``bench``, which has its own)."""
    top = argparse.ArgumentParser(
        prog="accy-async", description=__doc__.splitlines()[0].replace("``", "")
    )
    top.add_argument("--version", action="version", version=f"accy-async {__version__}")
    commands = top.add_subparsers(dest="command", required=True)
    add_demo_parser(commands)
    add_run_parser(commands)
    add_trace_parser(commands)
    add_validate_parser(commands)
    add_schema_parser(commands)
    add_tune_parser(commands)
    add_digests_parser(commands)

    commands.add_parser(
        "bench",
        help="GPU launch cost and completion latency (accy-async bench --help)",
        add_help=False,
    )
    return top


def _one_line(error: BaseException) -> str | None:
    """The message for an error a user can cause, or ``None`` for a bug (which keeps its trace)."""
    if isinstance(error, AccyError):
        return f"{type(error).__name__}: {error}"
    if isinstance(error, FileNotFoundError):
        return f"no such file: {error.filename}"
    if isinstance(error, IsADirectoryError):
        return f"{error.filename} is a folder, not a file"
    if isinstance(error, PermissionError):
        return f"permission denied: {error.filename}"
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    if isinstance(error, BaseExceptionGroup):
        lines = [_one_line(each) for each in error.exceptions]
        if all(line is not None for line in lines):
            return "; ".join(line for line in lines if line is not None)
    return None


def _report(run: Callable[[], int]) -> int:
    """``run()``, with a user's mistake (or Ctrl-C) as one line on stderr instead of a trace."""
    try:
        return run()
    except KeyboardInterrupt:
        print("accy-async: interrupted", file=sys.stderr)
        return 130
    except (AccyError, OSError, BaseExceptionGroup) as exc:
        line = _one_line(exc)
        if line is None:
            raise
        print(f"accy-async: {line}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a user's mistake, 130 on Ctrl-C)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"]:
        from accy_bench import main as bench_main  # the benchmarks: a package above this one

        return _report(lambda: bench_main(arguments[1:]))
    args = parser().parse_args(arguments)
    commands: dict[str, Callable[[], int]] = {
        "demo": lambda: anyio.run(demo, args),
        "run": lambda: anyio.run(run, args),
        "trace": lambda: anyio.run(run, args),
        "tune": lambda: anyio.run(tune, args),
        "validate": lambda: validate(args),
        "schema": lambda: schema(args),
        "digests": lambda: digests(args, load_document),
    }
    return _report(commands[args.command])


if __name__ == "__main__":
    sys.exit(main())
