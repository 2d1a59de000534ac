"""``accy-async tune``: tune a tuning document (the built-in kernels by default), with a cache.

Prints a progress bar on stderr while candidates finish, then one table row
per problem (``--all``: per candidate), or the results as JSON (``--json``).
Results are cached in ``--cache PATH`` (default
``$XDG_CACHE_HOME/accy-async/tuning.msgpack``; ``--no-cache`` to skip it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import anyio
import msgspec

from .backends import open_backend
from .cli_arguments import BACKEND_HELP, backend_kind, existing_file, positive_float, positive_int
from .cli_trust import add_trust_arguments, trust_policy_from, untrusted_explained
from .errors import AccyError
from .library import DEFAULT_TUNING_N, tuning_document
from .library.tuning import BUILTIN_TARGETS
from .plan import ArtifactFormat, TuningDocument, decode_json
from .trust import TrustPolicy
from .tuning import Tuner, TuningProblem, TuningProgress, TuningResult, TuningSettings

__all__ = ["add_tune_parser", "default_cache_path", "tune"]


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/accy-async/tuning.msgpack`` (``~/.cache`` when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "accy-async" / "tuning.msgpack"


def add_tune_parser(commands: Any) -> None:
    """Add the ``tune`` sub-command to ``commands`` (an argparse sub-parsers object)."""
    command = commands.add_parser("tune", help="tune kernels and pipelines, cache the winners")
    command.add_argument(
        "plan",
        nargs="?",
        help="a tuning document file, a built-in plan "
        f"({', '.join(BUILTIN_TARGETS)}) or problem name (default: every built-in kernel)",
    )
    command.add_argument(
        "--backend",
        type=backend_kind,
        default="auto",
        help=BACKEND_HELP,
    )
    command.add_argument(
        "-n", type=positive_int, default=DEFAULT_TUNING_N, help="built-in problem size"
    )
    command.add_argument("--cache", type=Path, help="cache file (default: the user's cache)")
    command.add_argument("--no-cache", action="store_true", help="neither read nor write a cache")
    command.add_argument(
        "--budget", type=positive_float, help="seconds per problem before skipping the rest"
    )
    command.add_argument("--flush-cache", action="store_true", help="flush L2 before samples")
    command.add_argument(
        "--sequential", action="store_true", help="compile and measure one after another"
    )
    command.add_argument("--all", action="store_true", help="a row per candidate")
    command.add_argument("--json", action="store_true", help="print the results as JSON")
    command.add_argument("--quiet", action="store_true", help="no progress bar")
    add_trust_arguments(command)


class _ProgressBar:
    """``[###...] done/total ~Ns left  last candidate`` on one terminal line (else plain lines).

    The time left is the time per candidate so far times the candidates to go.
    """

    WIDTH = 30

    def __init__(self, stream: TextIO, total: int, *, quiet: bool) -> None:
        self.stream = stream
        self.total = total
        self.done = 0
        self.quiet = quiet
        self.tty = stream.isatty()
        self.started = time.perf_counter()

    def left(self) -> str:
        """About how long the candidates to go will take, by the pace so far."""
        elapsed = time.perf_counter() - self.started
        seconds = elapsed / max(1, self.done) * max(0, self.total - self.done)
        return f"~{seconds:.0f} s left"

    def __call__(self, progress: TuningProgress) -> None:
        self.done += 1
        if self.quiet:
            return
        filled = self.WIDTH * self.done // max(1, self.total)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        candidate = progress.candidate
        what = (
            f"{candidate.median_seconds * 1e6:.1f} us"
            if candidate.status == "ok"
            else candidate.status
        )
        line = (
            f"[{bar}] {self.done}/{self.total} {self.left()} "
            f"{progress.problem}: {candidate.label} {what}"
        )
        if self.tty:
            print(f"\r\x1b[2K{line[:160]}", end="", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=self.stream, flush=True)


def _table(results: Sequence[TuningResult], every: bool) -> str:
    rows = [("problem", "candidate", "median us", "spread", "samples", "status")]
    for result in results:
        shown = result.candidates if every else [result.best] if result.best else []
        for candidate in shown:
            assert candidate is not None
            mark = "*" if candidate.index == result.winner else " "
            rows.append(
                (
                    result.problem + (" (cached)" if result.cached else ""),
                    f"{mark}{candidate.index:>2} {candidate.label}",
                    f"{candidate.median_seconds * 1e6:.2f}" if candidate.status == "ok" else "-",
                    f"{candidate.spread:.1%}" if candidate.status == "ok" else "-",
                    str(candidate.samples),
                    candidate.status if not candidate.error else f"failed: {candidate.error[:60]}",
                )
            )
        if not shown:
            rows.append((result.problem, "(no candidate ran)", "-", "-", "0", "failed"))
        failed = sum(1 for each in result.candidates if each.status != "ok")
        if not every and failed:
            rows.append(("", f"  {failed} of {len(result.candidates)} did not run", "", "", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _plan_file(reference: str | None) -> Path | None:
    """The tuning document file named, ``None`` for the built-ins (all, or by name)."""
    if reference is None:
        return None
    path = existing_file(reference, "tuning document file")
    if path is not None:
        return path
    names = {name for targets in BUILTIN_TARGETS.values() for name in targets}
    if reference in BUILTIN_TARGETS or reference in names:
        return None
    raise AccyError(
        f"{reference!r} is neither a file, a built-in plan ({', '.join(BUILTIN_TARGETS)}) "
        f"nor a built-in problem ({', '.join(sorted(names))})"
    )


def _selected(problems: list[TuningProblem], name: str | None) -> list[TuningProblem]:
    """The built-in problems of plan or problem ``name`` (all of them for ``None``)."""
    if name is None:
        return problems
    wanted = BUILTIN_TARGETS.get(name, (name,))
    return [problem for problem in problems if problem.name in wanted]


async def tune(args: argparse.Namespace) -> int:
    """Run ``accy-async tune``; 0 when every problem has a winner."""
    plan_file = _plan_file(args.plan)
    policy = trust_policy_from(args)
    with untrusted_explained(args.plan or "the tuning plan"):
        return await _tune_on_backend(args, plan_file, policy)


async def _tune_on_backend(
    args: argparse.Namespace, plan_file: Path | None, policy: TrustPolicy | None
) -> int:
    async with open_backend(args.backend) as backend:
        backend.trust_policy = policy
        if plan_file is not None:
            document = decode_json(await anyio.Path(plan_file).read_bytes(), TuningDocument)
        else:
            fmt = (
                ArtifactFormat.CUDA_SOURCE
                if ArtifactFormat.CUDA_SOURCE in backend.formats
                else ArtifactFormat.CPU
            )
            document = tuning_document(fmt, args.n)
        problems: list[TuningProblem] = _selected(
            [*document.kernels, *document.pipelines], None if plan_file else args.plan
        )
        candidates = sum(len(p.candidates) for p in problems)
        if not args.quiet and not args.json:
            print(
                f"tuning {len(problems)} problems ({candidates} candidates) on {backend.name}; "
                "each candidate is compiled, warmed up and timed until its median settles",
                file=sys.stderr,
            )
        bar = _ProgressBar(sys.stderr, candidates, quiet=args.quiet or args.json)
        cache = None if args.no_cache else args.cache or default_cache_path()
        settings = TuningSettings(flush_cache=args.flush_cache)
        started = time.perf_counter()
        try:
            async with Tuner(
                backend,
                settings=settings,
                cache=cache,
                concurrent=not args.sequential,
                on_progress=bar,
            ) as tuner:
                results = await tuner.tune_all(problems, budget=args.budget)
        finally:
            bar.close()
        wall = time.perf_counter() - started
        device = backend.name
    if args.json:
        print(
            msgspec.json.encode(
                {"device": device, "wall_seconds": wall, "results": results}
            ).decode()
        )
    else:
        print(
            f"tuned {len(results)} problems on {device} in {wall:.2f} s"
            + (f" (cache: {cache})" if cache else "")
        )
        print(_table(results, args.all))
    if any(result.winner is None for result in results):
        raise AccyError("some problems have no candidate that ran; see the table")
    return 0
