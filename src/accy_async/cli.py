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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

import anyio
import anyio.to_thread
import msgspec
import numpy as np

from . import library
from ._version import __version__
from .backends import auto_backend_choice, open_backend
from .backends.base import Limits
from .backends.cpu import host_memory_available
from .backends.cpu_kernels import lookup_cpu_kernel
from .buffers import download, upload
from .cli_arguments import BACKEND_HELP, BACKENDS, existing_file, positive_int
from .cli_trust import (
    add_digests_parser,
    add_trust_arguments,
    digests,
    trust_policy_from,
    untrusted_explained,
)
from .errors import AccyError, InvalidArtifact, LimitExceeded, OutOfDeviceMemory
from .pipeline import (
    PipelineLaunch,
    allocate_pipeline_intermediates,
    choose_format,
    intermediate_byte_size,
    launch_pipeline,
    load_pipeline_artifacts,
)
from .plan import (
    CpuKernelPayload,
    DType,
    Fixed,
    LaunchGraphDocument,
    PipelineDocument,
    PlanDocument,
    ScalarArgument,
    decode_json,
    decode_msgpack,
    json_schema,
    resolve_quantity,
    scalar,
)
from .trust import TrustPolicy
from .tune_command import add_tune_parser, tune
from .waiting import wait_stream

__all__ = ["main", "parser"]


class _Progress:
    """Steps of long work on stderr, each with its elapsed time."""

    def __init__(self, stream: TextIO, *, quiet: bool = False) -> None:
        self.stream = stream
        self.quiet = quiet
        self.start = time.perf_counter()

    def step(self, message: str) -> None:
        if not self.quiet:
            elapsed = time.perf_counter() - self.start
            print(f"[{elapsed:7.3f} s] {message}", file=self.stream, flush=True)


_MSGPACK_SUFFIXES: Final = (".msgpack", ".mpk", ".msgpk")
"""Plan files with these suffixes are read as MessagePack; any other file as JSON."""


def _load_document(reference: str) -> PlanDocument:
    """A plan from a file path (JSON, or MessagePack by suffix), or a built-in plan by name."""
    path = existing_file(reference, "plan file")
    if path is not None:
        data = path.read_bytes()
        if path.suffix.lower() in _MSGPACK_SUFFIXES:
            packed: PlanDocument = decode_msgpack(data, PlanDocument)
            return packed
        document: PlanDocument = decode_json(data, PlanDocument)
        return document
    if reference in library.BUILTIN_PLANS:
        return library.load_builtin(reference)
    raise AccyError(
        f"{reference!r} is neither a file nor a built-in plan ({', '.join(library.BUILTIN_PLANS)})"
    )


# ----- demo --------------------------------------------------------------------------------


async def _demo(args: argparse.Namespace) -> int:
    progress = _Progress(sys.stderr, quiet=args.quiet)
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


async def _run(args: argparse.Namespace) -> int:
    document = _load_document(args.plan)
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


async def _run_on_backend(
    args: argparse.Namespace,
    document: PipelineDocument,
    scalars: tuple[ScalarArgument, ...],
    inputs: list[Any],
    sources: dict[str, str],
    out: anyio.Path,
    policy: TrustPolicy | None,
) -> int:
    progress = _Progress(sys.stderr, quiet=args.quiet)
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


# ----- validate and schema -----------------------------------------------------------------


def _validate(args: argparse.Namespace) -> int:
    failed = 0
    for reference in args.plans:
        problems = _problems_of(reference)
        if problems:
            failed += 1
            for problem in problems:
                print(f"{reference}: {type(problem).__name__}: {problem}")
        else:
            print(f"{reference}: valid")
    return 1 if failed else 0


def _problems_of(reference: str) -> list[AccyError]:
    """Every error of one plan file (or built-in name), each with its path in the document."""
    try:
        document = _load_document(reference)
    except AccyError as exc:
        return [exc]
    except OSError as exc:
        return [AccyError(f"cannot read it: {exc.strerror or exc}")]
    problems: list[AccyError] = []
    if isinstance(document, PipelineDocument):
        if not document.registry.entries:
            problems.append(
                InvalidArtifact("the registry has no kernels", path="$.registry.entries")
            )
        for fmt in sorted(document.registry.formats(), key=lambda f: f.value):
            problems.extend(
                _rooted(problem, "pipeline", f"[{fmt.value}] {problem.message}")
                for problem in document.pipeline.problems(document.registry, fmt)
            )
        problems.extend(_size_problems(document))
        problems.extend(_registration_problems(document))
    elif isinstance(document, LaunchGraphDocument) and document.graph is not None:
        try:
            document.graph.validate(document.artifact_plan)
        except AccyError as exc:
            problems.append(_rooted(exc, "graph", exc.message))
    return problems


def _size_problems(document: PipelineDocument) -> list[AccyError]:
    """Intermediates of fixed size that no backend would allocate (by the default limits)."""
    limit = Limits().max_buffer_bytes
    problems: list[AccyError] = []
    for index, spec in enumerate(document.pipeline.intermediates):
        if not isinstance(spec.extent, Fixed):
            continue  # sized by runtime scalars: checked by `run` and every launch
        try:
            size = intermediate_byte_size(spec, (), index)
        except AccyError as exc:
            problems.append(exc)
            continue
        if size > limit:
            problems.append(
                LimitExceeded(
                    f"intermediate {index} needs {size:,} bytes, over the {limit:,} bytes "
                    "a backend allocates at once by default",
                    path=f"$.pipeline.intermediates[{index}].extent",
                )
            )
    return problems


def _registration_problems(document: PipelineDocument) -> list[AccyError]:
    """CPU kernels the plan names that this process has not registered (`run` would fail)."""
    return [
        InvalidArtifact(
            f"[cpu] kernel {entry.payload.name!r} is not registered in this process (register "
            "it with @accy_async.cpu_kernel in the program that runs the plan)",
            path=f"$.registry.entries[{index}].payload.name",
        )
        for index, entry in enumerate(document.registry.entries)
        if isinstance(entry.payload, CpuKernelPayload)
        and lookup_cpu_kernel(entry.payload.name) is None
    ]


def _rooted(problem: AccyError, field: str, message: str) -> AccyError:
    """``problem`` with ``message``, its path moved under the document's ``field``."""
    path = problem.path
    if path is not None and path.startswith("$") and not path.startswith(f"$.{field}"):
        path = f"$.{field}{path[1:]}"
    return type(problem)(message, path=path)


def _schema(args: argparse.Namespace) -> int:
    text = msgspec.json.format(msgspec.json.encode(json_schema()), indent=2).decode()
    if args.output:
        try:
            Path(args.output).write_text(text + "\n")
        except OSError as exc:
            raise AccyError(
                f"--output {args.output}: cannot write it ({exc.strerror or exc})", path="--output"
            ) from None
    else:
        print(text)
    return 0


# ----- entry point -------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The command line's argument parser (every command but ``bench``, which has its own)."""
    top = argparse.ArgumentParser(
        prog="accy-async", description=__doc__.splitlines()[0].replace("``", "")
    )
    top.add_argument("--version", action="version", version=f"accy-async {__version__}")
    commands = top.add_subparsers(dest="command", required=True)

    demo_cmd = commands.add_parser("demo", help="prefix sum on the default backend, verified")
    demo_cmd.add_argument(
        "-n", type=positive_int, default=10_000_003, help="elements (default 10,000,003)"
    )
    demo_cmd.add_argument("--backend", choices=BACKENDS, default="auto", help=BACKEND_HELP)
    demo_cmd.add_argument(
        "--repeat", type=positive_int, default=5, help="timed runs; the best is shown (default 5)"
    )
    demo_cmd.add_argument("--seed", type=int, default=0, help="seed of the random input")
    demo_cmd.add_argument("--json", action="store_true", help="print one JSON object")
    demo_cmd.add_argument("--quiet", action="store_true", help="no progress on stderr")

    run_cmd = commands.add_parser("run", help="run a pipeline plan file or built-in plan")
    run_cmd.add_argument(
        "plan",
        help=f"a plan file (JSON, or MessagePack named *.msgpack), or one of "
        f"{', '.join(library.BUILTIN_PLANS)}",
    )
    run_cmd.add_argument(
        "--scalar",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a runtime scalar of the plan, e.g. n=1000 (repeat for each)",
    )
    run_cmd.add_argument(
        "--operand",
        action="append",
        default=[],
        metavar="NAME=FILE.npy",
        help="read an operand from a 1-D .npy of the plan's dtype (otherwise it is generated)",
    )
    run_cmd.add_argument(
        "--out",
        help="folder for the results and generated operands (default: a new ./accy-run-N)",
    )
    run_cmd.add_argument(
        "--force", action="store_true", help="overwrite .npy files already in --out"
    )
    run_cmd.add_argument("--backend", choices=BACKENDS, default="auto", help=BACKEND_HELP)
    run_cmd.add_argument("--seed", type=int, default=0, help="seed of generated operands")
    run_cmd.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_trust_arguments(run_cmd)

    validate_cmd = commands.add_parser("validate", help="check plan files, listing every error")
    validate_cmd.add_argument(
        "plans", nargs="+", help="plan files (JSON, or MessagePack named *.msgpack) or built-ins"
    )

    schema_cmd = commands.add_parser("schema", help="print the JSON Schema of plan files")
    schema_cmd.add_argument("--output", help="write it to this file instead")

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
        "demo": lambda: anyio.run(_demo, args),
        "run": lambda: anyio.run(_run, args),
        "tune": lambda: anyio.run(tune, args),
        "validate": lambda: _validate(args),
        "schema": lambda: _schema(args),
        "digests": lambda: digests(args, _load_document),
    }
    return _report(commands[args.command])


if __name__ == "__main__":
    sys.exit(main())
