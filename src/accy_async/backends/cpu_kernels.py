"""CPU kernels: Python functions registered in-process under a name that plans refer to.

A plan never carries code. Its CPU entries name a kernel (``CpuKernelPayload``),
and only functions registered here with :func:`cpu_kernel` can be named, so a
plan naming ``os.system`` or any other callable is refused at create time.

A CPU kernel is called on the stream's worker thread as
``fn(ctx, *buffers, *scalars)``: ``ctx`` is a :class:`CpuLaunchContext`,
each buffer a ``uint8`` NumPy array over the bound bytes (read-only when bound
``read_only``), each scalar a Python ``int`` or ``float``. Use
``buffer.view(np.float32)`` to see elements. An exception raised by a kernel is
a device fault: it poisons the backend, like an illegal address on a GPU.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, TypeAlias, TypeVar

__all__ = [
    "CpuKernelFunction",
    "CpuLaunchContext",
    "cpu_kernel",
    "describe",
    "lookup_cpu_kernel",
    "parse_defines",
    "registered_cpu_kernels",
    "unregister_cpu_kernel",
]

CpuKernelFunction: TypeAlias = Callable[..., None]
F = TypeVar("F", bound=CpuKernelFunction)

_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,255}$")
_registry: dict[str, CpuKernelFunction] = {}
_lock = threading.Lock()


_NO_DEFINES: Final[Mapping[str, str]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class CpuLaunchContext:
    """What a CPU kernel knows of its launch: geometry, diagnostic id and defines.

    ``defines`` are the artifact's ``-DNAME=VALUE`` compile options (``-DNAME``
    gives ``"1"``), so compiled variants of one kernel exist on the CPU too.
    """

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_memory_bytes: int
    diagnostic_id: str | None
    defines: Mapping[str, str] = field(default_factory=lambda: _NO_DEFINES)

    def define(self, name: str, default: int) -> int:
        """The integer value of define ``name``, or ``default`` when it is not defined."""
        value = self.defines.get(name)
        return default if value is None else int(value, 0)

    @property
    def threads_per_block(self) -> int:
        """``block[0] * block[1] * block[2]``."""
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def block_count(self) -> int:
        """``grid[0] * grid[1] * grid[2]``."""
        return self.grid[0] * self.grid[1] * self.grid[2]


def cpu_kernel(name: str, *, replace: bool = False) -> Callable[[F], F]:
    """Register the decorated function as the CPU kernel ``name``.

    Registering a second function under a name already taken raises
    ``ValueError`` unless ``replace`` is true.
    """
    if not _NAME.match(name):
        raise ValueError(f"CPU kernel name {name!r} is not a dotted identifier")

    def register(function: F) -> F:
        with _lock:
            existing = _registry.get(name)
            if existing is not None and existing is not function and not replace:
                raise ValueError(f"a CPU kernel is already registered as {name!r}")
            _registry[name] = function
        return function

    return register


_DEFINE: Final = re.compile(r"^(?:-D|--define-macro=)([A-Za-z_][A-Za-z0-9_]*)(?:=(.*))?$")


def parse_defines(options: Sequence[str]) -> Mapping[str, str]:
    """The defines of ``-DNAME[=VALUE]`` compile options; other options raise ``ValueError``.

    A CPU kernel has nothing to compile, so a define is the only option that
    means something to it; refusing the rest keeps a CUDA-only option from
    passing silently.
    """
    defines: dict[str, str] = {}
    for option in options:
        match = _DEFINE.match(option)
        if match is None:
            raise ValueError(f"a CPU kernel takes only -DNAME[=VALUE] options, got {option!r}")
        defines[match.group(1)] = "1" if match.group(2) is None else match.group(2)
    return MappingProxyType(defines) if defines else _NO_DEFINES


def unregister_cpu_kernel(name: str) -> None:
    """Forget the CPU kernel ``name`` (for tests); unknown names are ignored."""
    with _lock:
        _registry.pop(name, None)


def lookup_cpu_kernel(name: str) -> CpuKernelFunction | None:
    """The function registered as ``name``, or ``None``."""
    return _registry.get(name)


def registered_cpu_kernels() -> list[str]:
    """Every registered CPU kernel name, sorted."""
    with _lock:
        return sorted(_registry)


def describe(function: Any) -> str:
    """``module.qualname`` of a kernel function, for error messages."""
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"
