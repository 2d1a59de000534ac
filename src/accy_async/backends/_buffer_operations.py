"""A backend's buffer operations: allocate, write, copy, read back, fill.

Each checks its arguments (liveness, ranges, :class:`~._device_info.Limits`)
and the backend's health before it calls the primitive; a refused call
allocates and enqueues nothing.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidBuffer, LaunchArgumentMismatch, LimitExceeded, UnsupportedOperation
from ..plan import DType
from ._core import BackendCore
from ._handles import DEFAULT_ALIGNMENT, BufferBinding, BufferHandle, Ownership, StreamLike
from ._marks import PendingRead

__all__ = ["BufferOperations"]


class BufferOperations(BackendCore):
    """Buffers on the device, and copies to, from and between them."""

    def allocate_buffer(
        self,
        byte_size: int,
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        dtype: DType | None = None,
    ) -> BufferHandle:
        """A new buffer of ``byte_size`` bytes aligned to ``alignment`` (a power of two).

        Checked against :attr:`limits` before the device is asked.
        """
        self._check_usable()
        self.collect_deferred()
        if byte_size <= 0:
            raise InvalidBuffer(f"buffer size must be positive, got {byte_size}")
        if alignment <= 0 or alignment & (alignment - 1) or alignment > 4096:
            raise InvalidBuffer(f"alignment {alignment} is not a power of two up to 4096")
        if byte_size > self.limits.max_buffer_bytes:
            raise LimitExceeded(
                f"buffer of {byte_size} bytes exceeds the limit of "
                f"{self.limits.max_buffer_bytes} bytes per buffer"
            )
        held = self._registry.live_bytes
        if held + byte_size > self.limits.max_total_bytes:
            raise LimitExceeded(
                f"buffer of {byte_size} bytes would bring this backend to "
                f"{held + byte_size} bytes, over its limit of {self.limits.max_total_bytes}"
            )
        object_id = self._registry.new_id()
        native = self._allocate(object_id, byte_size, alignment)
        handle = BufferHandle(
            self.backend_id,
            object_id,
            native,
            byte_size,
            dtype=dtype,
            address=self._buffer_address(native),
        )
        self._registry.add(handle)
        return handle

    def mark_shared(self, buffer: BufferHandle) -> None:
        """Note that other libraries may use ``buffer`` on streams of theirs.

        A backend that keeps destroyed buffers' memory for reuse (CUDA) frees
        this one's instead, as the driver waits for work it cannot see.
        """
        del buffer

    def write_buffer(
        self,
        buffer: BufferHandle,
        data: bytes | bytearray | memoryview,
        *,
        offset: int = 0,
        stream: StreamLike | None = None,
    ) -> None:
        """Enqueue a copy of ``data`` into ``buffer`` at ``offset``.

        The bytes are taken now, so ``data`` may change after the call; the copy
        lands in stream order.
        """
        self._check_usable()
        view = memoryview(data).cast("B")
        self._check_range(buffer, offset, view.nbytes)
        handle = self._stream(stream)
        if self.tracer is None:
            self._write(buffer, view, offset, handle)
        else:
            self._traced(
                "write",
                f"{view.nbytes} bytes to buffer {buffer.id}",
                handle,
                lambda: self._write(buffer, view, offset, handle),
                bytes=view.nbytes,
            )

    def copy_buffer(
        self,
        source: BufferHandle,
        destination: BufferHandle,
        byte_size: int | None = None,
        *,
        source_offset: int = 0,
        destination_offset: int = 0,
        stream: StreamLike | None = None,
    ) -> None:
        """Enqueue a device-side copy of ``byte_size`` bytes (all of ``source`` by default).

        The ranges must lie inside their buffers, and must not overlap when
        both are one buffer (:class:`~accy_async.errors.InvalidBuffer`).
        """
        self._check_usable()
        size = source.byte_size - source_offset if byte_size is None else byte_size
        self._check_range(source, source_offset, size)
        self._check_range(destination, destination_offset, size)
        if (
            source is destination
            and source_offset < destination_offset + size
            and destination_offset < source_offset + size
        ):
            raise InvalidBuffer(
                f"copying {size} bytes within {source!r} from {source_offset} to "
                f"{destination_offset}: the ranges overlap"
            )
        if not size:
            return
        handle = self._stream(stream)
        if self.tracer is None:
            self._copy(source, source_offset, destination, destination_offset, size, handle)
        else:
            self._traced(
                "copy",
                f"{size} bytes, buffer {source.id} to {destination.id}",
                handle,
                lambda: self._copy(
                    source, source_offset, destination, destination_offset, size, handle
                ),
                bytes=size,
            )

    def check_copy(
        self,
        source_backend: BufferOperations,
        source: BufferHandle,
        destination: BufferHandle,
        byte_size: int | None = None,
        *,
        source_offset: int = 0,
        destination_offset: int = 0,
    ) -> int:
        """The bytes a copy from ``source_backend``'s ``source`` into ``destination`` moves.

        Raises :class:`InvalidBuffer` (at ``$.source[0]`` or ``$.destination[0]``)
        unless each range lies in a live buffer of its backend. ``byte_size``
        defaults to the rest of ``source``.
        """
        size = source.byte_size - source_offset if byte_size is None else byte_size
        source_backend.check_bindings(
            [BufferBinding(source, "read_only", offset=source_offset, byte_size=size)], "$.source"
        )
        self.check_bindings(
            [BufferBinding(destination, offset=destination_offset, byte_size=size)], "$.destination"
        )
        return size

    def copy_from(
        self,
        source_backend: BufferOperations,
        source: BufferHandle,
        destination: BufferHandle,
        byte_size: int | None = None,
        *,
        source_offset: int = 0,
        destination_offset: int = 0,
        after: StreamLike | None = None,
        stream: StreamLike | None = None,
    ) -> None:
        """Enqueue on ``stream`` a copy from another backend's buffer (another device's, say).

        The copy runs after the work queued so far on ``after`` (a stream of
        ``source_backend``; its default when ``None``), ordered on the device,
        with no host synchronisation; later work on ``stream`` sees it. The
        source buffer must stay alive until the copy has run (await ``stream``
        first). CUDA backends only (peer copies, direct where the devices
        allow peer access, else staged by the driver); elsewhere
        :class:`~accy_async.errors.UnsupportedOperation`:
        :func:`accy_async.copy_between` stages any pair through the host.
        """
        self._check_usable()
        source_backend._check_usable()
        if not self._copies_from(source_backend):
            raise UnsupportedOperation(
                f"the {self.kind} backend cannot copy from a {source_backend.kind} backend's "
                "buffer on the device: accy_async.copy_between stages it through the host"
            )
        size = self.check_copy(
            source_backend,
            source,
            destination,
            byte_size,
            source_offset=source_offset,
            destination_offset=destination_offset,
        )
        source_stream = source_backend._stream(after)
        handle = self._stream(stream)
        if not size:
            return

        def enqueue() -> None:
            self._copy_from(
                source_backend,
                source,
                source_offset,
                destination,
                destination_offset,
                size,
                source_stream,
                handle,
            )

        if self.tracer is None:
            enqueue()
        else:
            where = (
                f"{size} bytes from {source_backend.kind} buffer {source.id} to {destination.id}"
            )
            self._traced("copy", where, handle, enqueue, bytes=size)

    def enqueue_read(
        self,
        buffer: BufferHandle,
        *,
        offset: int = 0,
        byte_size: int | None = None,
        stream: StreamLike | None = None,
    ) -> PendingRead:
        """Enqueue a copy of ``buffer``'s bytes to the host; await it, then take ``result()``."""
        self._check_usable()
        size = buffer.byte_size - offset if byte_size is None else byte_size
        self._check_range(buffer, offset, size)
        handle = self._stream(stream)
        if self.tracer is None:
            return self._enqueue_read(buffer, offset, size, handle)
        return self._traced(
            "read",
            f"{size} bytes from buffer {buffer.id}",
            handle,
            lambda: self._enqueue_read(buffer, offset, size, handle),
            bytes=size,
        )

    def fill_buffer(
        self, buffer: BufferHandle, pattern: int, *, stream: StreamLike | None = None
    ) -> None:
        """Enqueue filling ``buffer`` with the 32-bit ``pattern``, repeated.

        Raises :class:`~accy_async.errors.UnsupportedOperation` when the backend
        cannot fill this buffer (its size is not a multiple of 4, say).
        """
        self._check_usable()
        self._check_buffer(buffer)
        if not 0 <= pattern <= 0xFFFFFFFF:
            raise LaunchArgumentMismatch(f"fill pattern {pattern} is not a u32")
        handle = self._stream(stream)
        if self.tracer is None:
            self._fill(buffer, pattern, handle)
        else:
            self._traced(
                "fill",
                f"buffer {buffer.id}",
                handle,
                lambda: self._fill(buffer, pattern, handle),
                bytes=buffer.byte_size,
            )

    def register_external_buffer(self, native: Any, byte_size: int) -> BufferHandle:
        """Track memory this backend does not own as a buffer; destroying it only forgets it."""
        self._check_usable()
        handle = BufferHandle(
            self.backend_id,
            self._registry.new_id(),
            native,
            byte_size,
            ownership=Ownership.EXTERNAL,
            address=self._buffer_address(native) if native is not None else 0,
        )
        self._registry.add(handle)
        return handle
