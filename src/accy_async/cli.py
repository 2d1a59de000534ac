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
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import anyio
import anyio.to_thread
import msgspec
import numpy as np

from . import library
from .backends import auto_backend_choice, open_backend
from .buffers import download, upload
from .errors import AccyError, InvalidArtifact, PlanError
from .pipeline import (
    PipelineLaunch,
    allocate_pipeline_intermediates,
    choose_format,
    launch_pipeline,
    load_pipeline_artifacts,
)
from .plan import (
    DType,
    LaunchGraphDocument,
    PipelineDocument,
    PlanDocument,
    ScalarArgument,
    decode_json,
    json_schema,
    resolve_quantity,
    scalar,
)
from .tune_command import add_tune_parser, tune
from .waiting import wait_stream

__all__ = ["main"]

BACKENDS = ("auto", "cuda", "cpu")


class Progress:
    """Steps of long work on stderr, each with its elapsed time."""

    def __init__(self, stream: TextIO, *, quiet: bool = False) -> None:
        self.stream = stream
        self.quiet = quiet
        self.start = time.perf_counter()

    def step(self, message: str) -> None:
        if not self.quiet:
            elapsed = time.perf_counter() - self.start
            print(f"[{elapsed:7.3f} s] {message}", file=self.stream, flush=True)


def load_document(reference: str) -> PlanDocument:
    """A plan from a file path, or a built-in plan by name."""
    path = Path(reference)
    if path.exists():
        document: PlanDocument = decode_json(path.read_bytes(), PlanDocument)
        return document
    if reference in library.BUILTIN_PLANS:
        return library.load_builtin(reference)
    raise AccyError(
        f"{reference!r} is neither a file nor a built-in plan ({', '.join(library.BUILTIN_PLANS)})"
    )


# ----- demo --------------------------------------------------------------------------------


async def demo(args: argparse.Namespace) -> int:
    progress = Progress(sys.stderr, quiet=args.quiet)
    n = args.n
    if args.backend == "auto":
        choice, reason = auto_backend_choice()
        progress.step(f"auto backend: {choice} ({reason})")
    document = library.prefix_sum(DType.F32, 256)
    rng = np.random.default_rng(args.seed)
    values = rng.integers(0, 4, n).astype(np.float32)  # sums stay exact in float32 up to 2**22
    expected = np.cumsum(values.astype(np.float64))
    async with open_backend(args.backend) as backend:
        progress.step(f"backend: {backend.name}")
        fmt = choose_format(backend, document)
        scalars: tuple[ScalarArgument, ...] = (scalar("u32", n),)
        progress.step(f"loading the 3-stage prefix sum ({fmt.value})")
        pool = await load_pipeline_artifacts(backend, document.pipeline, document.registry, fmt)
        scratch = await allocate_pipeline_intermediates(backend, document.pipeline, scalars)
        source = upload(backend, values)
        result = backend.allocate_buffer(4 * n)
        async with pool, scratch:
            request = PipelineLaunch(
                pipeline=document.pipeline,
                registry=document.registry,
                format=fmt,
                operands=[source.bind("read_only")],
                results=[result.bind()],
                runtime_scalar_arguments=scalars,
                intermediates=scratch,
                artifacts=pool,
            )
            times = []
            for repeat in range(args.repeat):
                start = time.perf_counter()
                await launch_pipeline(backend, request)
                await wait_stream(backend)
                times.append(time.perf_counter() - start)
                progress.step(f"run {repeat + 1}/{args.repeat}: {times[-1] * 1e3:.3f} ms")
            got = await download(backend, result, np.float32, n)
        backend.destroy_all([source, result])
        name = backend.name
        kind = backend.kind
    exact = bool(np.array_equal(got.astype(np.float64), expected)) if n <= 2**22 else None
    close = bool(np.allclose(got, expected, rtol=1e-5, atol=1e-2))
    best = min(times)
    report = {
        "backend": kind,
        "device": name,
        "n": n,
        "best_ms": best * 1e3,
        "elements_per_second": n / best,
        "gigabytes_per_second": 2 * 4 * n / best / 1e9,
        "verified": close and exact is not False,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"accy-async demo: inclusive prefix sum of {n:,} float32 on {kind} ({name})")
        print(f"  time:       {best * 1e3:.3f} ms (best of {args.repeat})")
        print(
            f"  throughput: {n / best / 1e6:,.1f} M elements/s, "
            f"{2 * 4 * n / best / 1e9:.2f} GB/s (read + write)"
        )
        print(f"  checked against NumPy: {'OK' if report['verified'] else 'MISMATCH'}")
    return 0 if report["verified"] else 1


# ----- run ---------------------------------------------------------------------------------


def parse_scalars(document: PipelineDocument, given: Sequence[str]) -> tuple[ScalarArgument, ...]:
    """``NAME=VALUE`` (or positional ``VALUE``) pairs as the pipeline's typed runtime scalars."""
    pipeline = document.pipeline
    count = pipeline.runtime_scalar_argument_count
    names = list(document.runtime_scalar_names)
    types = list(pipeline.runtime_scalar_types) or ["u32"] * count
    values: list[str | None] = [None] * count
    for position, item in enumerate(given):
        name, _, value = item.partition("=")
        if not value:
            name, value = (names[position] if position < len(names) else str(position)), item
        index = names.index(name) if name in names else (int(name) if name.isdigit() else -1)
        if not 0 <= index < count:
            raise AccyError(f"unknown runtime scalar {name!r}; the plan takes {names or count}")
        values[index] = value
    missing = [names[i] if i < len(names) else str(i) for i, v in enumerate(values) if v is None]
    if missing:
        raise AccyError(f"give the runtime scalars {missing} with --scalar NAME=VALUE")
    return tuple(
        scalar(kind, float(value) if kind.startswith("f") else int(value, 0))
        for kind, value in zip(types, values, strict=True)
        if value is not None
    )


def make_operand(
    spec_dtype: DType, count: int, source: str | None, rng: np.random.Generator
) -> np.ndarray[Any, Any]:
    dtype = np.dtype(spec_dtype.numpy_name)
    if source is not None:
        array = np.load(source)
        if array.size != count:
            raise AccyError(f"{source} holds {array.size} elements, the plan needs {count}")
        return np.ascontiguousarray(array.reshape(-1), dtype=dtype)
    if dtype.kind == "f":
        return rng.random(count).astype(dtype)
    return rng.integers(0, 100, count).astype(dtype)


async def run(args: argparse.Namespace) -> int:
    progress = Progress(sys.stderr, quiet=args.quiet)
    document = load_document(args.plan)
    if not isinstance(document, PipelineDocument):
        raise AccyError("`run` takes pipeline plans; this file holds a launch graph")
    if (not document.operands and document.pipeline.operand_count) or (
        not document.results and document.pipeline.result_count
    ):
        raise AccyError(
            "the plan does not describe its operands and results, so `run` cannot size them"
        )
    scalars = parse_scalars(document, args.scalar)
    sources = dict(item.partition("=")[::2] for item in args.operand)
    rng = np.random.default_rng(args.seed)
    inputs = [
        make_operand(
            spec.dtype, resolve_quantity(spec.extent, scalars), sources.get(spec.name), rng
        )
        for spec in document.operands
    ]
    out = anyio.Path(args.out)
    await out.mkdir(parents=True, exist_ok=True)
    async with open_backend(args.backend) as backend:
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
            progress.step(f"done in {elapsed * 1e3:.3f} ms; reading results")
            for spec, buffer in zip(document.results, results, strict=True):
                values = await download(
                    backend, buffer, spec.dtype, resolve_quantity(spec.extent, scalars)
                )
                path = out / f"{spec.name}.npy"
                await anyio.to_thread.run_sync(np.save, str(path), values)
                print(f"{spec.name}: {values.size} {spec.dtype.value} -> {path}")
            for spec, values in zip(document.operands, inputs, strict=True):
                if spec.name not in sources:
                    await anyio.to_thread.run_sync(np.save, str(out / f"{spec.name}.npy"), values)
        finally:
            backend.destroy_all([*operands, *results])
    return 0


# ----- validate and schema -----------------------------------------------------------------


def validate(args: argparse.Namespace) -> int:
    failed = 0
    for reference in args.plans:
        problems: list[AccyError] = []
        try:
            document = load_document(reference)
        except PlanError as exc:
            problems.append(exc)
        else:
            if isinstance(document, PipelineDocument):
                if not document.registry.entries:
                    problems.append(
                        InvalidArtifact("the registry has no kernels", path="$.registry.entries")
                    )
                for fmt in sorted(document.registry.formats(), key=lambda f: f.value):
                    problems.extend(
                        type(problem)(
                            f"[{fmt.value}] {problem.message}",
                            path=f"$.pipeline{problem.path[1:]}" if problem.path else None,
                        )
                        for problem in document.pipeline.problems(document.registry, fmt)
                    )
            elif isinstance(document, LaunchGraphDocument) and document.graph is not None:
                try:
                    document.graph.validate(document.artifact_plan)
                except AccyError as exc:
                    problems.append(exc)
        if problems:
            failed += 1
            for problem in problems:
                print(f"{reference}: {type(problem).__name__}: {problem}")
        else:
            print(f"{reference}: valid")
    return 1 if failed else 0


def schema(args: argparse.Namespace) -> int:
    text = msgspec.json.format(msgspec.json.encode(json_schema()), indent=2).decode()
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


# ----- entry point -------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="accy-async", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)

    demo_cmd = commands.add_parser("demo", help="prefix sum on the default backend, verified")
    demo_cmd.add_argument("-n", type=int, default=10_000_003, help="elements (default 10,000,003)")
    demo_cmd.add_argument("--backend", choices=BACKENDS, default="auto")
    demo_cmd.add_argument("--repeat", type=int, default=5)
    demo_cmd.add_argument("--seed", type=int, default=0)
    demo_cmd.add_argument("--json", action="store_true", help="print one JSON object")
    demo_cmd.add_argument("--quiet", action="store_true", help="no progress on stderr")

    run_cmd = commands.add_parser("run", help="run a pipeline plan file or built-in plan")
    run_cmd.add_argument("plan", help=f"a plan file, or one of {', '.join(library.BUILTIN_PLANS)}")
    run_cmd.add_argument("--scalar", action="append", default=[], metavar="NAME=VALUE")
    run_cmd.add_argument(
        "--operand",
        action="append",
        default=[],
        metavar="NAME=FILE.npy",
        help="read an operand from .npy (otherwise it is generated)",
    )
    run_cmd.add_argument("--out", default=".", help="folder for the results' .npy files")
    run_cmd.add_argument("--backend", choices=BACKENDS, default="auto")
    run_cmd.add_argument("--seed", type=int, default=0)
    run_cmd.add_argument("--quiet", action="store_true")

    validate_cmd = commands.add_parser("validate", help="check plan files, listing every error")
    validate_cmd.add_argument("plans", nargs="+")

    schema_cmd = commands.add_parser("schema", help="print the JSON Schema of plan files")
    schema_cmd.add_argument("--output", help="write it to this file")

    add_tune_parser(commands, BACKENDS)

    bench_cmd = commands.add_parser(
        "bench", help="GPU launch cost and completion latency", add_help=False
    )
    bench_cmd.add_argument("bench_arguments", nargs=argparse.REMAINDER)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(arguments[1:])
    args = parser().parse_args(arguments)
    try:
        if args.command == "demo":
            return anyio.run(demo, args)
        if args.command == "run":
            return anyio.run(run, args)
        if args.command == "tune":
            return anyio.run(tune, args)
        if args.command == "validate":
            return validate(args)
        return schema(args)
    except AccyError as exc:
        print(f"accy-async: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
