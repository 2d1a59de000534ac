"""Our buffers offered to other libraries: DLPack and the CUDA Array Interface, no copy.

An :class:`ArrayView` is a typed 1-D array over a backend buffer::

    y = accy.ArrayView(backend, buffer, np.float32, stream=stream)
    t = torch.from_dlpack(y)            # same memory; torch's stream waits for ``stream``
    c = cupy.asarray(y)                 # the CUDA Array Interface, version 3

When a consumer asks for DLPack with its stream (PyTorch and CuPy pass their
current one), that stream is made to wait on the device for the work queued on
the view's stream so far: no host synchronisation. The CUDA Array Interface
names the view's stream instead, and the consumer orders itself after it.

A view does not own its buffer unless the library made it so (the high-level
call's results for DLPack-only operands): then the buffer is released once the
view and every tensor taken from it are gone and the work queued on the view's
stream has finished. Work a consumer queued on its own stream is covered by
CUDA itself: ``cuMemFree`` waits for the device to finish with the memory (a
view's buffer is freed when destroyed, never kept for reuse by the backend). A
view over the caller's buffer must not outlive that buffer; nor may a tensor
taken from any view outlive the backend, which frees its buffers when it closes.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from . import dlpack
from .backends import Backend, BufferHandle, StreamHandle
from .errors import InvalidBuffer, UnsupportedOperation

__all__ = ["ArrayView"]


class _Owned:
    """What a view's finalizer needs: the buffer to release and the stream to wait for."""

    __slots__ = ("buffer", "stream")

    def __init__(self, buffer: BufferHandle, stream: StreamHandle | None) -> None:
        self.buffer = buffer
        self.stream = stream


def _release(backend: Backend, owned: _Owned) -> None:
    backend.release_from_any_thread([owned.buffer], after=owned.stream)


class ArrayView:
    """``size`` elements of ``dtype`` at the start of ``buffer``, for other libraries to take.

    ``stream`` is where the work that writes the buffer is queued (``None``:
    the backend's default stream). Raises :class:`InvalidBuffer` for a buffer
    that is not live on ``backend`` or is smaller than ``size`` elements.
    """

    __slots__ = ("__weakref__", "_owned", "_stream", "backend", "buffer", "dtype", "size")

    def __init__(
        self,
        backend: Backend,
        buffer: BufferHandle,
        dtype: Any,
        size: int | None = None,
        *,
        stream: StreamHandle | None = None,
        owned: bool = False,
    ) -> None:
        dtype = np.dtype(dtype)
        backend.check_bindings([buffer.bind()], "$.buffer")
        count = buffer.byte_size // dtype.itemsize if size is None else size
        if count < 0 or count * dtype.itemsize > buffer.byte_size:
            raise InvalidBuffer(
                f"{count} elements of {dtype} do not fit in {buffer!r} ({buffer.byte_size} bytes)",
                path="$.size",
            )
        backend.mark_shared(buffer)  # other libraries' streams may use it: freed, never reused
        self.backend = backend
        self.buffer = buffer
        self.dtype: np.dtype[Any] = dtype
        self.size = count
        self._stream = stream
        self._owned: _Owned | None = None
        if owned:
            self._owned = _Owned(buffer, stream)
            weakref.finalize(self, _release, backend, self._owned)

    @classmethod
    def allocate(cls, backend: Backend, dtype: Any, size: int) -> ArrayView:
        """A view over a new buffer of ``size`` elements of ``dtype``, owned by the view.

        The buffer is freed, once the work writing it is done, when the last
        reference to the view goes.
        """
        dtype = np.dtype(dtype)
        buffer = backend.allocate_buffer(max(size * dtype.itemsize, 1))
        return cls(backend, buffer, dtype, size, owned=True)

    @property
    def stream(self) -> StreamHandle | None:
        """The stream the buffer's writers are queued on (``None``: the default stream)."""
        return self._stream

    @stream.setter
    def stream(self, stream: StreamHandle | None) -> None:
        self._stream = stream
        if self._owned is not None:
            self._owned.stream = stream

    @property
    def address(self) -> int:
        """The first element's address (a device pointer on CUDA)."""
        return self.buffer.address

    @property
    def shape(self) -> tuple[int]:
        """``(size,)``."""
        return (self.size,)

    @property
    def nbytes(self) -> int:
        """How many bytes the elements take."""
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"<ArrayView {self.size} x {self.dtype} in {self.buffer!r}>"

    # ----- DLPack -----------------------------------------------------------------------

    def __dlpack_device__(self) -> tuple[int, int]:
        """The buffer's device, as DLPack names it (``(2, ordinal)`` on CUDA, ``(1, 0)`` on CPU)."""
        try:
            return self.backend.dlpack_device
        except UnsupportedOperation as exc:
            raise BufferError(str(exc)) from None

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule of the elements, the consumer's ``stream`` ordered after ours.

        ``stream`` follows the array API: on CUDA ``None`` or 1 is the legacy
        default stream, 2 the per-thread one, -1 asks for no ordering, any
        other value (or an object with ``__cuda_stream__``) is the
        consumer's stream. A capsule of DLPack 1.0 when ``max_version`` allows,
        else a legacy one. Raises :class:`BufferError` when the buffer is gone,
        for another ``dl_device``, or for ``copy=True`` (nothing is copied).
        """
        device = self.__dlpack_device__()
        if not self.backend.owns(self.buffer):
            raise BufferError(f"{self.buffer!r} was destroyed")
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"the array is on DLPack device {device}, not {tuple(dl_device)}")
        if copy:
            raise BufferError("accy-async offers its buffers in place; copy=True is not supported")
        if device[0] == dlpack.CUDA and stream != -1:
            if stream == 0:
                raise BufferError(
                    "stream 0 is ambiguous in DLPack: pass 1 (legacy) or 2 (per-thread)"
                )
            self.backend.lead_foreign_stream(1 if stream is None else stream, self.live_stream)
        versioned = max_version is not None and max_version[0] >= 1
        return dlpack.export(
            self.address, self.dtype, self.shape, device, self, versioned=versioned
        )

    # ----- the CUDA Array Interface ------------------------------------------------------

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3, naming the stream a consumer must order itself after (CUDA only)."""
        if self.backend.kind != "cuda":
            raise AttributeError(f"a {self.backend.kind} buffer has no __cuda_array_interface__")
        if not self.backend.owns(self.buffer):
            raise BufferError(f"{self.buffer!r} was destroyed")
        stream = self.live_stream or self.backend.default_stream
        raw = stream.__cuda_stream__()[1]
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.address, False),
            "version": 3,
            "strides": None,
            "stream": raw or 1,  # the interface forbids 0: the NULL stream is the legacy one
        }

    @property
    def live_stream(self) -> StreamHandle | None:
        """The view's stream, or ``None`` (the backend's default) once that stream is gone.

        A stream is gone once its owner has waited for it (the high-level call
        destroys a lane's stream only after its work), so ordering after the
        default stream then orders after nothing that matters.
        """
        stream = self._stream
        return stream if stream is not None and self.backend.owns(stream) else None
