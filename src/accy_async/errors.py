"""The errors accy-async raises.

Every error the library raises on purpose derives from :class:`AccyError`, so
``except accy.AccyError`` catches all of them. Lower-level errors (msgspec's
``ValidationError``, a ``CUresult`` from the driver, an NVRTC log, an exception
from a CPU kernel) are translated at the boundary with ``raise ... from exc``,
so the original stays on ``__cause__``.

The tree::

    AccyError
    ├── PlanError                   a plan is malformed; ``path`` names the bad field
    ├── InvalidArtifact             a kernel artifact is missing, unresolvable or unusable
    │   └── CompilationError        NVRTC (or another compiler) refused a source; ``log``
    ├── LaunchArgumentMismatch      arguments do not fit the kernel, pipeline or graph
    │   └── LimitExceeded           a size, count or scalar is beyond a configured limit
    ├── InvalidBuffer               a buffer handle is unknown, destroyed, foreign or too small
    ├── UnsupportedOperation        the backend cannot do what was asked
    ├── OutOfDeviceMemory           an allocation failed
    ├── RuntimeUnavailable          the backend, driver or device cannot be used
    │   └── BackendClosed           the backend was closed
    └── DeviceFault                 a sticky device error: the backend is poisoned

Errors that concern one field of a plan or request carry ``path``, a
JSON-path-like string such as ``$.stages[1].buffers[0]``; ``str(error)`` ends
with it. ``DeviceFault`` is sticky: once raised by a backend, every waiter on
that backend fails with it and new work is refused at once.
"""

from __future__ import annotations

__all__ = [
    "AccyError",
    "BackendClosed",
    "CompilationError",
    "DeviceFault",
    "InvalidArtifact",
    "InvalidBuffer",
    "LaunchArgumentMismatch",
    "LimitExceeded",
    "OutOfDeviceMemory",
    "PlanError",
    "RuntimeUnavailable",
    "UnsupportedOperation",
    "UntrustedKernel",
]


class AccyError(Exception):
    """Base class of every error accy-async raises.

    ``message`` says what was wrong; ``path``, when set, names where (the field
    of a plan or request, as ``$.stages[0].target``).
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.message = message
        self.path = path
        super().__init__(message if path is None else f"{message} - at `{path}`")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.message, self.path, self.__dict__))


def _rebuild(
    cls: type[AccyError], message: str, path: str | None, state: dict[str, object]
) -> AccyError:
    error = cls.__new__(cls)
    AccyError.__init__(error, message, path=path)
    error.__dict__.update(state)
    return error


class PlanError(AccyError, ValueError):
    """A plan (registry, pipeline, artifact plan or launch graph) is malformed.

    Raised when decoding a plan fails (unknown field, wrong tag, value out of
    bounds) and when its semantic checks fail (dangling reference, cycle, too
    many arguments). ``path`` names the bad field. It is also a ``ValueError``,
    so msgspec reports it with its path when it is raised while decoding.
    """


class InvalidArtifact(AccyError):
    """A kernel artifact is missing, cannot be resolved, or does not match its use."""


class CompilationError(InvalidArtifact):
    """A compiler refused a kernel source; ``log`` holds what it printed."""

    def __init__(self, message: str, *, log: str = "", path: str | None = None) -> None:
        super().__init__(message if not log else f"{message}\n{log}", path=path)
        self.log = log


class UntrustedKernel(InvalidArtifact):
    """A CUDA kernel whose digest the backend's trust policy does not list (see ``trust``)."""


class LaunchArgumentMismatch(AccyError):
    """Buffers, scalars or geometry do not fit the kernel, pipeline or graph."""


class LimitExceeded(LaunchArgumentMismatch):
    """A size, count, extent or runtime scalar is beyond a configured limit."""


class InvalidBuffer(AccyError):
    """A buffer handle is unknown, already destroyed, from another backend, or too small."""


class UnsupportedOperation(AccyError):
    """The backend cannot perform the operation (a format it cannot load, say)."""


class OutOfDeviceMemory(AccyError):
    """A device (or, on the CPU backend, host) allocation failed."""


class RuntimeUnavailable(AccyError):
    """The backend, driver or device cannot be used for this call."""


class BackendClosed(RuntimeUnavailable):
    """The backend was closed; open a new one."""


class DeviceFault(AccyError):
    """A sticky device error (illegal address, launch failure, a CPU kernel that raised).

    The backend that raised it is poisoned: every pending wait fails with this
    error and every later call is refused with it at once. Close the backend
    and open a new one.
    """
