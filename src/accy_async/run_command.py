"""``accy-async run``: a pipeline plan (a file or a built-in's name) on generated or .npy operands.

The runtime scalars come from ``--scalar NAME=VALUE``, operands from
``--operand NAME=FILE.npy`` or generated; everything is checked (and the
host's memory asked) before the backend opens. The results and the
generated operands are written as ``.npy`` files into ``--out``. The plan's
CUDA kernels compile in a worker process, and only if trusted (see
:mod:`accy_async.cli_trust`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from . import library
from .backends import open_backend
from .backends.cpu import host_memory_available
from .buffers import download, upload
from .cli_arguments import BACKEND_HELP, Progress, backend_kind, load_document
from .cli_trust import add_trust_arguments, trust_policy_from, untrusted_explained
from .errors import AccyError, OutOfDeviceMemory
from .pipeline import PipelineLaunch, choose_format, launch_pipeline
from .plan import DType, PipelineDocument, ScalarArgument, resolve_quantity, scalar
from .tracing import trace
from .trust import TrustPolicy

__all__ = ["add_run_parser", "add_trace_parser", "run"]


def add_run_parser(commands: Any) -> None:
    """Add the ``run`` sub-command to ``commands`` (an argparse sub-parsers object)."""
    command = commands.add_parser("run", help="run a pipeline plan file or built-in plan")
    _add_run_arguments(command)
    command.set_defaults(trace_output=None, host_only=False)


def add_trace_parser(commands: Any) -> None:
    """Add ``trace``: ``run``, recorded as a Chrome trace (Perfetto, ``chrome://tracing``)."""
    command = commands.add_parser(
        "trace",
        help="run a pipeline plan and write a timeline of what ran (Chrome trace JSON)",
    )
    _add_run_arguments(command)
    command.add_argument(
        "-o",
        "--output",
        dest="trace_output",
        default="trace.json",
        help="the trace file to write (default: trace.json); open it in https://ui.perfetto.dev",
    )
    command.add_argument(
        "--host-only",
        action="store_true",
        help="record the host's side only (enqueues, waits), not the device's times",
    )


def _add_run_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "plan",
        help=f"a plan file (JSON, or MessagePack named *.msgpack), or one of "
        f"{', '.join(library.BUILTIN_PLANS)}",
    )
    command.add_argument(
        "--scalar",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a runtime scalar of the plan, e.g. n=1000 (repeat for each)",
    )
    command.add_argument(
        "--operand",
        action="append",
        default=[],
        metavar="NAME=FILE.npy",
        help="read an operand from a 1-D .npy of the plan's dtype (otherwise it is generated)",
    )
    command.add_argument(
        "--out",
        help="folder for the results and generated operands (default: a new ./accy-run-N)",
    )
    command.add_argument(
        "--force", action="store_true", help="overwrite .npy files already in --out"
    )
    command.add_argument("--backend", type=backend_kind, default="auto", help=BACKEND_HELP)
    command.add_argument("--seed", type=int, default=0, help="seed of generated operands")
    command.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_trust_arguments(command)


async def run(args: argparse.Namespace) -> int:
    """Run ``run``: check everything, then launch the plan and write its results."""
    document = load_document(args.plan)
    if not isinstance(document, PipelineDocument):
        raise AccyError("`run` takes pipeline plans; this file holds a launch graph")
    if (not document.operands and document.pipeline.operand_count) or (
        not document.results and document.pipeline.result_count
    ):
        raise AccyError(
            "the plan does not describe its operands and results, so `run` cannot size them"
        )
    scalars = _parse_scalars(document, args.scalar)
    sources = _parse_operand_files(document, args.operand)
    _check_host_memory(document, scalars)
    rng = np.random.default_rng(args.seed)
    inputs = [
        _make_operand(
            spec.name,
            spec.dtype,
            resolve_quantity(spec.extent, scalars),
            sources.get(spec.name),
            rng,
        )
        for spec in document.operands
    ]
    folder = _output_folder(args.out)
    written = [spec.name for spec in document.results] + [
        spec.name for spec in document.operands if spec.name not in sources
    ]
    clashes = [name for name in written if (folder / f"{name}.npy").exists()]
    if clashes and not args.force:
        raise AccyError(
            f"{folder} already holds {', '.join(f'{name}.npy' for name in clashes)}; "
            "give another --out, or --force to overwrite",
            path="--out",
        )
    if folder.exists() and not folder.is_dir():
        raise AccyError(f"--out {folder}: not a folder", path="--out")
    out = anyio.Path(folder)
    policy = trust_policy_from(args)
    with untrusted_explained(args.plan):
        return await _run_on_backend(args, document, scalars, inputs, sources, out, policy)


def _parse_scalars(document: PipelineDocument, given: Sequence[str]) -> tuple[ScalarArgument, ...]:
    """``NAME=VALUE`` (or positional ``VALUE``) pairs as the pipeline's typed runtime scalars."""
    pipeline = document.pipeline
    count = pipeline.runtime_scalar_argument_count
    names = list(document.runtime_scalar_names)
    types = list(pipeline.runtime_scalar_types) or ["u32"] * count
    values: list[str | None] = [None] * count
    labels = [names[index] if index < len(names) else str(index) for index in range(count)]
    for position, item in enumerate(given):
        name, _, value = item.partition("=")
        if not value:
            name, value = (names[position] if position < len(names) else str(position)), item
        index = names.index(name) if name in names else (int(name) if name.isdigit() else -1)
        if not 0 <= index < count:
            raise AccyError(f"unknown runtime scalar {name!r}; the plan takes {names or count}")
        values[index] = value
    missing = [label for label, value in zip(labels, values, strict=True) if value is None]
    if missing:
        raise AccyError(f"give the runtime scalars {missing} with --scalar NAME=VALUE")
    parsed = []
    for label, kind, text in zip(labels, types, values, strict=True):
        assert text is not None
        try:
            parsed.append(scalar(kind, float(text) if kind.startswith("f") else int(text, 0)))
        except (ValueError, AccyError) as exc:
            reason = exc.message if isinstance(exc, AccyError) else "not a number"
            raise AccyError(
                f"--scalar {label}={text}: {reason} ({kind})", path=f"--scalar {label}"
            ) from None
    return tuple(parsed)


def _parse_operand_files(document: PipelineDocument, given: Sequence[str]) -> dict[str, str]:
    """``NAME=FILE.npy`` items as a dict, every name one of the plan's operands."""
    known = [spec.name for spec in document.operands]
    files: dict[str, str] = {}
    for item in given:
        name, equals, file = item.partition("=")
        if not equals or not name or not file:
            raise AccyError(f"--operand {item!r}: write it as NAME=FILE.npy", path="--operand")
        if name not in known:
            raise AccyError(
                f"--operand {name}: the plan has no operand {name!r} (it takes {known})",
                path="--operand",
            )
        files[name] = file
    return files


def _make_operand(
    name: str, spec_dtype: DType, count: int, source: str | None, rng: np.random.Generator
) -> np.ndarray[Any, Any]:
    """Operand ``name`` read from ``source`` (checked against the plan) or generated."""
    dtype = np.dtype(spec_dtype.numpy_name)
    if source is None:
        if dtype.kind == "f":
            return rng.random(count).astype(dtype)
        return rng.integers(0, 100, count).astype(dtype)
    if Path(source).is_dir():
        raise AccyError(f"--operand {name}={source}: a folder, not a .npy file", path="--operand")
    try:
        array = np.load(source, allow_pickle=False)
    except (ValueError, EOFError) as exc:
        raise AccyError(
            f"--operand {name}={source}: not a .npy array ({exc})", path="--operand"
        ) from None
    if not isinstance(array, np.ndarray):
        raise AccyError(f"--operand {name}={source}: not a single .npy array", path="--operand")
    if array.dtype != dtype:
        raise AccyError(
            f"--operand {name}={source}: holds {array.dtype}, the plan takes {dtype} "
            f"(convert it first, e.g. np.save(path, array.astype(np.{dtype})))",
            path="--operand",
        )
    if array.ndim != 1 or array.size != count:
        raise AccyError(
            f"--operand {name}={source}: shape {array.shape}, the plan takes ({count},)",
            path="--operand",
        )
    return np.ascontiguousarray(array)


def _check_host_memory(document: PipelineDocument, scalars: Sequence[ScalarArgument]) -> None:
    """Refuse a run whose arrays (and their generation) would not fit in the host's memory."""
    available = host_memory_available()
    specs = [*document.operands, *document.results]
    # Each array lives on the host (generated or read, then downloaded); generating one goes
    # through 8-byte values.
    needed = sum(resolve_quantity(spec.extent, scalars) * (spec.dtype.size + 8) for spec in specs)
    if available is not None and needed > available:
        raise OutOfDeviceMemory(
            f"the operands and results need about {needed:,} bytes of host memory; "
            f"{available:,} are available (give smaller runtime scalars)"
        )


def _output_folder(requested: str | None) -> Path:
    """``--out`` as given, or a fresh ``accy-run-N`` folder in the working folder."""
    if requested is not None:
        return Path(requested)
    for number in range(1, 10_000):
        candidate = Path(f"accy-run-{number}")
        if not candidate.exists():
            return candidate
    raise AccyError("no free accy-run-N folder here; give --out")


async def _run_on_backend(
    args: argparse.Namespace,
    document: PipelineDocument,
    scalars: tuple[ScalarArgument, ...],
    inputs: list[Any],
    sources: dict[str, str],
    out: anyio.Path,
    policy: TrustPolicy | None,
) -> int:
    progress = Progress(sys.stderr, quiet=args.quiet)
    async with open_backend(args.backend) as backend, backend.parallel_compilation(1):
        # Compiled in a worker process, under the compile limits (docs/security.md).
        backend.trust_policy = policy
        fmt = choose_format(backend, document)
        progress.step(f"{backend.kind} backend ({backend.name}), {fmt.value} kernels")
        operands = [upload(backend, values) for values in inputs]
        results = [
            backend.allocate_buffer(
                max(1, resolve_quantity(spec.extent, scalars) * spec.dtype.size)
            )
            for spec in document.results
        ]
        try:
            progress.step(f"launching {document.pipeline.target}")
            start = time.perf_counter()
            with contextlib.ExitStack() as tracing:
                tracer = (
                    None
                    if args.trace_output is None
                    else tracing.enter_context(trace(backend, device_times=not args.host_only))
                )
                await launch_pipeline(
                    backend,
                    PipelineLaunch(
                        pipeline=document.pipeline,
                        registry=document.registry,
                        format=fmt,
                        operands=[b.bind("read_only") for b in operands],
                        results=[b.bind() for b in results],
                        runtime_scalar_arguments=scalars,
                    ),
                )
            elapsed = time.perf_counter() - start
            if tracer is not None:  # launch_pipeline waited for the work: the times are in
                await anyio.to_thread.run_sync(tracer.write, args.trace_output)
                print(f"trace: {len(tracer.records)} records -> {args.trace_output}")
            progress.step(f"done in {elapsed * 1e3:.3f} ms; reading results")
            await out.mkdir(parents=True, exist_ok=True)  # only now: a failed run writes nothing
            for spec, buffer in zip(document.results, results, strict=True):
                values = await download(
                    backend, buffer, spec.dtype, resolve_quantity(spec.extent, scalars)
                )
                path = out / f"{spec.name}.npy"
                await anyio.to_thread.run_sync(np.save, str(path), values)
                print(f"{spec.name}: {values.size} {spec.dtype.value} -> {path}")
            for spec, values in zip(document.operands, inputs, strict=True):
                if spec.name not in sources:
                    path = out / f"{spec.name}.npy"
                    await anyio.to_thread.run_sync(np.save, str(path), values)
                    print(f"{spec.name}: {values.size} {spec.dtype.value} (generated) -> {path}")
        finally:
            backend.destroy_all([*operands, *results])
    return 0
