"""Artifact formats, kernel payloads, artifact specs, and the kernel-call registry."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Annotated, Final, TypeAlias

import msgspec

from ._base import ArgumentCount, Base, Name, Tagged, Version, plan_error
from .geometry import KernelCallLaunch
from .scalars import DType

__all__ = [
    "ArtifactFormat",
    "ArtifactSpec",
    "BinaryPayload",
    "CpuKernelPayload",
    "KernelCallRegistry",
    "Payload",
    "RegistryEntry",
    "TextPayload",
    "check_compile_options",
]

_MAX_PAYLOAD_BYTES: Final = 64 * 1024 * 1024


class ArtifactFormat(enum.Enum):
    """What a kernel payload is, and so which backend can load it."""

    CUDA_SOURCE = "cuda_source"
    """CUDA C++ source, compiled by NVRTC to a cubin for the device (PTX as fallback)."""
    CUDA_PTX = "cuda_ptx"
    """PTX text, JIT-compiled by the driver at load."""
    CUDA_CUBIN = "cuda_cubin"
    """A cubin (or fatbin) binary for the device's architecture."""
    CPU = "cpu"
    """The name of a CPU kernel registered in-process with ``@accy.cpu_kernel``."""


class TextPayload(Tagged, tag="text", kw_only=False, frozen=True):
    """Source or PTX text."""

    text: Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_PAYLOAD_BYTES)]


class BinaryPayload(Tagged, tag="binary", kw_only=False, frozen=True):
    """A binary image (cubin or fatbin); base64 in JSON."""

    data: Annotated[bytes, msgspec.Meta(min_length=1, max_length=_MAX_PAYLOAD_BYTES)]


class CpuKernelPayload(Tagged, tag="cpu_kernel", kw_only=False, frozen=True):
    """The registered name of a CPU kernel; decoding it runs nothing."""

    name: Name


Payload: TypeAlias = TextPayload | BinaryPayload | CpuKernelPayload

_PAYLOAD_FOR_FORMAT: Final = {
    ArtifactFormat.CUDA_SOURCE: TextPayload,
    ArtifactFormat.CUDA_PTX: TextPayload,
    ArtifactFormat.CUDA_CUBIN: BinaryPayload,
    ArtifactFormat.CPU: CpuKernelPayload,
}

CompileOption = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Feature = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


_SAFE_OPTIONS: Final = re.compile(
    r"-D[A-Za-z_][A-Za-z0-9_]*(=[^\x00-\x1f]*)?"
    r"|-U[A-Za-z_][A-Za-z0-9_]*"
    r"|--?(use_fast_math|lineinfo|generate-line-info|restrict|extra-device-vectorization"
    r"|default-device|device-as-default-execution-space|disable-warnings|device-debug)"
    r"|-[Gw]"
    r"|--?std=c\+\+(11|14|17|20|03)"
    r"|--?(ftz|prec-div|prec-sqrt|fmad)=(true|false)"
    r"|--?maxrregcount=[0-9]{1,3}"
    r"|--?dopt=(on|off)"
    r"|-O[0-3]"
    r"|-Ofast-compile=(max|mid|min|0)"
)
"""Compile options a plan may carry: macros and code-generation switches. Nothing that names
a host path (include paths, pre-includes), and no ``-arch`` (the backend picks it)."""


def check_compile_options(options: Sequence[str], *prefix: str | int) -> None:
    """Refuse a compile option outside the allowlist, naming it (see ``docs/security.md``)."""
    for index, option in enumerate(options):
        if not _SAFE_OPTIONS.fullmatch(option):
            raise plan_error(
                f"compile option {option!r} is not allowed in a plan: plans may define and "
                "undefine macros and switch code generation (-D, -U, --use_fast_math, "
                "-lineinfo, --std=, --ftz=, --fmad=, --maxrregcount=, -O0..3, ...); include "
                "paths and options that read host files are refused",
                *prefix,
                "compile_options",
                index,
            )


def _check_payload(format: ArtifactFormat, payload: Payload, *prefix: str | int) -> None:
    """Refuse a payload whose kind does not fit ``format`` (text for PTX, say)."""
    expected = _PAYLOAD_FOR_FORMAT[format]
    if type(payload) is not expected:
        raise plan_error(
            f"format {format.value!r} needs a {expected.__struct_config__.tag!r} payload, "
            f"got {_payload_kind(payload)}",
            *prefix,
            "payload",
        )


def _payload_kind(payload: object) -> str:
    """What a payload is, for an error: its tag, or the Python type of a non-payload."""
    config = getattr(type(payload), "__struct_config__", None)
    tag = None if config is None else config.tag
    return repr(tag) if isinstance(tag, str) else f"a {type(payload).__name__}"


class ArtifactSpec(Base, frozen=True):
    """What a backend needs to create (compile) one kernel artifact.

    ``argument_count`` counts buffers and scalars together;
    ``scalar_argument_count`` of them are scalars, which come after the buffers.
    """

    kernel_name: Name
    format: ArtifactFormat
    payload: Payload
    argument_count: ArgumentCount
    scalar_argument_count: ArgumentCount = 0
    required_dtypes: tuple[DType, ...] = ()
    required_features: tuple[Feature, ...] = ()
    compile_options: tuple[CompileOption, ...] = ()
    diagnostic_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None

    def __post_init__(self) -> None:
        if self.scalar_argument_count > self.argument_count:
            raise plan_error(
                f"scalar_argument_count {self.scalar_argument_count} exceeds "
                f"argument_count {self.argument_count}",
                "scalar_argument_count",
            )
        _check_payload(self.format, self.payload)
        check_compile_options(self.compile_options)

    @property
    def buffer_argument_count(self) -> int:
        """How many buffers the kernel takes (its arguments less its scalars)."""
        return self.argument_count - self.scalar_argument_count


class RegistryEntry(Base, frozen=True):
    """One kernel that a pipeline stage can name by ``(target, version, format)``.

    The port of the seed's ``KernelCallArtifact``: ``argument_count`` counts
    buffers and runtime scalars together, scalars last.
    """

    target: Name
    version: Version
    format: ArtifactFormat
    entry_name: Name
    argument_count: ArgumentCount
    payload: Payload
    launch: KernelCallLaunch
    runtime_scalar_argument_count: ArgumentCount = 0
    required_dtypes: tuple[DType, ...] = ()
    required_features: tuple[Feature, ...] = ()
    compile_options: tuple[CompileOption, ...] = ()

    def __post_init__(self) -> None:
        if self.runtime_scalar_argument_count > self.argument_count:
            raise plan_error(
                f"runtime_scalar_argument_count {self.runtime_scalar_argument_count} exceeds "
                f"argument_count {self.argument_count}",
                "runtime_scalar_argument_count",
            )
        _check_payload(self.format, self.payload)
        check_compile_options(self.compile_options)

    @property
    def scalar_argument_count(self) -> int:
        """How many scalar arguments the kernel takes (after its buffers)."""
        return self.runtime_scalar_argument_count

    @property
    def buffer_argument_count(self) -> int:
        """How many buffer arguments the kernel takes."""
        return self.argument_count - self.runtime_scalar_argument_count

    def artifact_spec(self, diagnostic_id: str | None = None) -> ArtifactSpec:
        """The spec a backend creates this entry's artifact from."""
        return ArtifactSpec(
            kernel_name=self.entry_name,
            format=self.format,
            payload=self.payload,
            argument_count=self.argument_count,
            scalar_argument_count=self.runtime_scalar_argument_count,
            required_dtypes=self.required_dtypes,
            required_features=self.required_features,
            compile_options=self.compile_options,
            diagnostic_id=diagnostic_id,
        )


class KernelCallRegistry(Base, frozen=True):
    """The kernels pipelines may call, at most one per ``(target, version, format)``."""

    entries: tuple[RegistryEntry, ...] = ()

    def __post_init__(self) -> None:
        seen: dict[tuple[str, int, ArtifactFormat], int] = {}
        for index, entry in enumerate(self.entries):
            key = (entry.target, entry.version, entry.format)
            if key in seen:
                raise plan_error(
                    f"duplicate entry for {entry.target!r} version {entry.version} "
                    f"format {entry.format.value!r} (first at entries[{seen[key]}])",
                    "entries",
                    index,
                )
            seen[key] = index

    def find(self, target: str, version: int, format: ArtifactFormat) -> RegistryEntry | None:
        """The entry for ``(target, version, format)``, or ``None``."""
        for entry in self.entries:
            if entry.target == target and entry.version == version and entry.format is format:
                return entry
        return None

    def formats(self) -> frozenset[ArtifactFormat]:
        """Every format some entry provides."""
        return frozenset(entry.format for entry in self.entries)
