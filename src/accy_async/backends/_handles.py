"""Handles: what a backend gives out for the objects it owns, and bindings of buffers.

Every handle names its backend and its id there; the backend keeps the live ones
(:meth:`~accy_async.backends.base.Backend.owns`). ``native`` is the backend's own
object (a CUDA pointer or stream, a NumPy array, a worker thread).
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Final, Literal, Protocol, TypeAlias, runtime_checkable

from ..errors import InvalidBuffer
from ..plan import ArtifactSpec, DType

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_STREAM_ID",
    "Access",
    "BufferBinding",
    "BufferHandle",
    "DeviceObject",
    "EventHandle",
    "KernelArtifact",
    "LoadedArtifact",
    "Ownership",
    "StreamHandle",
    "StreamLike",
    "SupportsCudaStream",
    "is_external",
    "raw_handle_of",
    "raw_stream_handle",
]

DEFAULT_ALIGNMENT: Final = 256
"""Byte alignment of every buffer a backend allocates (the seeds' 256)."""

DEFAULT_STREAM_ID: Final = 0
"""The default stream's id; objects a backend creates are numbered from 1."""

Access: TypeAlias = Literal["read_only", "write_only", "read_write"]
"""How a launch may use a buffer. The CPU backend enforces ``read_only``."""


class Ownership(enum.Enum):
    """Who frees a buffer: the backend that allocated it, or someone else."""

    BACKEND = "backend"
    EXTERNAL = "external"


class DeviceObject:
    """Something a backend created and must destroy exactly once."""

    __slots__ = ("backend_id", "id", "native")
    kind: ClassVar[str] = "object"

    def __init__(self, backend_id: int, object_id: int, native: Any) -> None:
        self.backend_id = backend_id
        self.id = object_id
        self.native = native

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} of backend {self.backend_id}>"


class BufferHandle(DeviceObject):
    """A buffer of ``byte_size`` bytes; ``native`` is the backend's own (pointer, array)."""

    __slots__ = ("address", "byte_size", "dtype", "ownership")
    kind = "buffer"

    def __init__(
        self,
        backend_id: int,
        object_id: int,
        native: Any,
        byte_size: int,
        *,
        ownership: Ownership = Ownership.BACKEND,
        dtype: DType | None = None,
        address: int = 0,
    ) -> None:
        super().__init__(backend_id, object_id, native)
        self.byte_size = byte_size
        self.ownership = ownership
        self.dtype = dtype
        self.address = address
        """Where the buffer starts in the backend's address space (a device pointer on CUDA)."""

    def bind(
        self, access: Access = "read_write", *, offset: int = 0, byte_size: int | None = None
    ) -> BufferBinding:
        """A binding of this buffer (or of ``byte_size`` bytes at ``offset``) for a launch."""
        return BufferBinding(self, access, offset=offset, byte_size=byte_size)


class StreamHandle(DeviceObject):
    """An in-order queue of device work.

    On CUDA it speaks the ``__cuda_stream__`` protocol, so PyTorch, CuPy and
    cuda.core take it where they take a stream. ``external`` streams belong to
    another library (see :meth:`Backend.adopt_stream`): destroying one only
    forgets it.
    """

    __slots__ = ("external",)
    kind = "stream"

    def __init__(
        self, backend_id: int, object_id: int, native: Any, *, external: bool = False
    ) -> None:
        super().__init__(backend_id, object_id, native)
        self.external = external

    def __cuda_stream__(self) -> tuple[int, int]:
        """``(0, the raw CUstream handle)``, the protocol of cuda.core (CUDA streams only)."""
        try:
            return (0, int(self.native))
        except TypeError:
            raise TypeError(f"{self!r} is not a CUDA stream") from None


@runtime_checkable
class SupportsCudaStream(Protocol):
    """A stream of another library: ``__cuda_stream__()`` gives ``(0, raw handle)``."""

    def __cuda_stream__(self) -> tuple[int, int]: ...


StreamLike: TypeAlias = "StreamHandle | SupportsCudaStream | int"
"""Where a stream is taken: a :class:`StreamHandle`, another library's stream
(anything with ``__cuda_stream__``: cuda.core, CuPy, PyTorch; or
``cuda_stream``, PyTorch's older spelling), or a raw ``CUstream`` handle."""


def raw_stream_handle(stream: object) -> int:
    """The raw ``CUstream`` handle of another library's stream, or :class:`InvalidBuffer`."""
    if isinstance(stream, bool):
        raise InvalidBuffer(f"{stream!r} is not a stream", path="$.stream")
    if isinstance(stream, int):
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        try:
            version, handle = protocol()
        except Exception as exc:
            raise InvalidBuffer(
                f"{type(stream).__name__}.__cuda_stream__() failed: {exc}", path="$.stream"
            ) from exc
        if version != 0:
            raise InvalidBuffer(
                f"{type(stream).__name__} speaks __cuda_stream__ version {version}; "
                "accy-async knows version 0",
                path="$.stream",
            )
        return int(handle)
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream before the protocol
    if isinstance(handle, int) and not isinstance(handle, bool):
        return handle
    raise InvalidBuffer(
        f"{type(stream).__name__} is not a stream (a StreamHandle, an object with "
        "__cuda_stream__, or a raw CUstream handle)",
        path="$.stream",
    )


class EventHandle(DeviceObject):
    """A marker recorded on a stream; complete once the work before it has finished.

    ``timing`` events can be given to :meth:`Backend.elapsed_seconds`.
    """

    __slots__ = ("timing",)
    kind = "event"

    def __init__(self, backend_id: int, object_id: int, native: Any, *, timing: bool) -> None:
        super().__init__(backend_id, object_id, native)
        self.timing = timing


class LoadedArtifact(DeviceObject):
    """A kernel loaded onto the device (a module and its function), ready to launch."""

    __slots__ = ("artifact",)
    kind = "loaded_artifact"

    def __init__(self, backend_id: int, object_id: int, native: Any, artifact: KernelArtifact):
        super().__init__(backend_id, object_id, native)
        self.artifact = artifact


class KernelArtifact:
    """A created (compiled) kernel: its spec and the backend's image of it.

    Host memory only; the garbage collector frees it. ``image`` is a cubin or
    PTX for CUDA, the kernel function for the CPU backend. ``ptx`` is the PTX
    a CUDA image was made from, where known (empty otherwise): device graphs
    make the kernel's argument-table variant from it.
    """

    __slots__ = ("image", "image_format", "ptx", "spec")

    def __init__(self, spec: ArtifactSpec, image: Any, image_format: str, ptx: bytes = b"") -> None:
        self.spec = spec
        self.image = image
        self.image_format = image_format
        self.ptx = ptx

    @property
    def scalar_argument_count(self) -> int:
        """Scalars the kernel takes, after its buffers."""
        return self.spec.scalar_argument_count

    @property
    def buffer_argument_count(self) -> int:
        """Buffers the kernel takes."""
        return self.spec.buffer_argument_count

    def __repr__(self) -> str:
        return f"<KernelArtifact {self.spec.kernel_name} ({self.image_format})>"


class BufferBinding:
    """A buffer (or a byte range of it) bound to a launch argument with an access mode.

    ``address`` is where the bound range starts (the handle's address plus
    ``offset``), as a kernel receives it.
    """

    __slots__ = ("_views", "access", "address", "byte_size", "handle", "offset")

    def __init__(
        self,
        handle: BufferHandle,
        access: Access = "read_write",
        *,
        offset: int = 0,
        byte_size: int | None = None,
    ) -> None:
        self.handle = handle
        self.access: Access = access
        self.offset = offset
        self.address = handle.address + offset
        self.byte_size = handle.byte_size - offset if byte_size is None else byte_size
        self._views: dict[str, BufferBinding] | None = None
        """The same range with other access modes, made once each (a launch graph's runs
        bind the same slots with the same modes call after call)."""

    def with_access(self, access: Access) -> BufferBinding:
        """The same range with another access mode (the same object each time it is asked)."""
        if access == self.access:
            return self
        views = self._views
        if views is None:
            views = self._views = {}
        view = views.get(access)
        if view is None:
            view = views[access] = BufferBinding(
                self.handle, access, offset=self.offset, byte_size=self.byte_size
            )
        return view

    def aliases(self, other: BufferBinding) -> bool:
        """Whether both bind the same buffer (the seed's rule: same backend, same id)."""
        return (
            self.handle.backend_id == other.handle.backend_id and self.handle.id == other.handle.id
        )

    def __repr__(self) -> str:
        return (
            f"<BufferBinding {self.handle.id} {self.access} "
            f"[{self.offset}:{self.offset + self.byte_size}]>"
        )


def is_external(obj: DeviceObject) -> bool:
    """Whether ``obj`` belongs to someone else: an external buffer or an adopted stream."""
    if isinstance(obj, BufferHandle):
        return obj.ownership is Ownership.EXTERNAL
    return isinstance(obj, StreamHandle) and obj.external


def raw_handle_of(stream: StreamHandle) -> int | None:
    """``stream``'s raw ``CUstream`` handle, ``None`` for a stream that is not CUDA's."""
    try:
        return stream.__cuda_stream__()[1]
    except TypeError:
        return None
