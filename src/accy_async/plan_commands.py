"""``accy-async validate`` and ``accy-async schema``: plan files checked, and their JSON Schema.

``validate`` lists every error of each plan file (or built-in plan), each
with its path in the document: the chain against its registry in every
format it has, intermediates of fixed size no backend would allocate, CPU
kernels this process has not registered, a launch graph against its plan.
``schema`` prints (or writes) the JSON Schema of plan files.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec

from .backends import Limits
from .backends.cpu_kernels import lookup_cpu_kernel
from .cli_arguments import load_document
from .errors import AccyError, InvalidArtifact, LimitExceeded
from .pipeline import intermediate_byte_size
from .plan import CpuKernelPayload, Fixed, LaunchGraphDocument, PipelineDocument, json_schema

__all__ = ["add_schema_parser", "add_validate_parser", "schema", "validate"]


def add_validate_parser(commands: Any) -> None:
    """Add the ``validate`` sub-command to ``commands`` (an argparse sub-parsers object)."""
    command = commands.add_parser("validate", help="check plan files, listing every error")
    command.add_argument(
        "plans", nargs="+", help="plan files (JSON, or MessagePack named *.msgpack) or built-ins"
    )


def add_schema_parser(commands: Any) -> None:
    """Add the ``schema`` sub-command to ``commands`` (an argparse sub-parsers object)."""
    command = commands.add_parser("schema", help="print the JSON Schema of plan files")
    command.add_argument("--output", help="write it to this file instead")


def validate(args: argparse.Namespace) -> int:
    """Run ``validate``: 1 if any plan has an error, else 0."""
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
        document = load_document(reference)
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


def schema(args: argparse.Namespace) -> int:
    """Run ``schema``: print the JSON Schema, or write it to ``--output``."""
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
