"""NumPy conveniences over a backend's buffers: upload an array, download one back."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .backends import Backend, BufferHandle, StreamLike, WaitPolicy
from .plan import DType
from .waiting import wait_read

__all__ = ["download", "upload"]


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
