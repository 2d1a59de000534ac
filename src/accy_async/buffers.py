"""Conveniences over backends' buffers: upload an array, download one back, copy across devices."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._loops import checkpoint
from .backends import Backend, BufferHandle, StreamLike, WaitPolicy
from .errors import UnsupportedOperation
from .plan import DType
from .waiting import wait_read

__all__ = ["copy_between", "download", "upload"]


def upload(
    backend: Backend,
    array: npt.ArrayLike,
    *,
    dtype: npt.DTypeLike | None = None,
    stream: StreamLike | None = None,
) -> BufferHandle:
    """A new buffer holding ``array``'s bytes (C order); the copy lands in stream order.

    The caller destroys the buffer (``backend.destroy``) once done with it.
    """
    values = np.ascontiguousarray(array, dtype=dtype)
    buffer = backend.allocate_buffer(
        max(values.nbytes, 1), dtype=DType.from_numpy(values.dtype.name)
    )
    try:
        if values.nbytes:
            backend.write_buffer(buffer, values.reshape(-1).view(np.uint8).data, stream=stream)
    except BaseException:
        backend.destroy(buffer)
        raise
    return buffer


async def download(
    backend: Backend,
    buffer: BufferHandle,
    dtype: npt.DTypeLike | DType,
    count: int | None = None,
    *,
    offset: int = 0,
    stream: StreamLike | None = None,
    policy: WaitPolicy | None = None,
) -> np.ndarray[Any, Any]:
    """Read ``count`` elements of ``dtype`` from ``buffer`` at byte ``offset``.

    The read lands once the work queued before it on ``stream`` has finished;
    it is awaited as :func:`~accy_async.wait_read` awaits it (``policy`` as
    there), never blocking the loop. ``count`` defaults to the rest of the
    buffer.
    """
    element = np.dtype(dtype.numpy_name if isinstance(dtype, DType) else dtype)
    size = (buffer.byte_size - offset) // element.itemsize if count is None else count
    data = await wait_read(
        backend.enqueue_read(
            buffer, offset=offset, byte_size=size * element.itemsize, stream=stream
        ),
        policy=policy,
    )
    return np.frombuffer(data, dtype=element).copy()


async def copy_between(
    source_backend: Backend,
    source: BufferHandle,
    destination_backend: Backend,
    destination: BufferHandle,
    byte_size: int | None = None,
    *,
    source_offset: int = 0,
    destination_offset: int = 0,
    after: StreamLike | None = None,
    stream: StreamLike | None = None,
) -> None:
    """Copy ``byte_size`` bytes of one backend's buffer into another's (another device's, say).

    The copy follows the work queued so far on ``after`` (a stream of
    ``source_backend``) and lands on ``stream`` (of ``destination_backend``)
    in order with what is queued there; both default to the backends' own.

    * Two CUDA backends (two GPUs, or one): enqueued on the device
      (:meth:`~accy_async.backends.Backend.copy_from`: an event wait and
      ``cuMemcpyPeerAsync``, direct where the devices have peer access);
      this returns once it is enqueued, without waiting for the device.
    * Any other pair (CPU backends, or a CPU and a CUDA one): staged through
      the host: the bytes are read once ``after``'s work is done (awaited
      without blocking the loop), then written on ``stream``; this returns
      once they are read.

    Either way the source buffer must stay alive until the copy has run
    (await ``stream``). Ranges are checked first (:class:`~accy_async.errors.InvalidBuffer`,
    nothing enqueued); a checkpoint even when there is nothing to copy.
    """
    try:
        destination_backend.copy_from(
            source_backend,
            source,
            destination,
            byte_size,
            source_offset=source_offset,
            destination_offset=destination_offset,
            after=after,
            stream=stream,
        )
    except UnsupportedOperation:  # no device path between these two: through the host
        size = destination_backend.check_copy(
            source_backend,
            source,
            destination,
            byte_size,
            source_offset=source_offset,
            destination_offset=destination_offset,
        )
    else:
        await checkpoint()
        return
    if not size:
        await checkpoint()
        return
    data = await wait_read(
        source_backend.enqueue_read(source, offset=source_offset, byte_size=size, stream=after)
    )
    destination_backend.write_buffer(destination, data, offset=destination_offset, stream=stream)
