"""A high-level call like an earlier one on its lane, replayed from what that one decided.

A service calls the same :class:`~accy_async.call.PipelineCall` on device
arrays again and again, often the very same memory (``out=`` buffers it
keeps, a caching allocator handing back the same blocks) with the same
scalars, on the same stream. Everything such a call checks and decides (the
arrays' dtypes and sizes, what the scalars resolve to, the stream it runs on,
each stage's packed arguments) follows from what the arrays say of
themselves (address, shape, dtype, strides, read-only flag, stream), the
scalars and the stream given. :func:`replay_key` reads exactly that, and a
lane keeps a :class:`Replay` per key: a call with the key of one launched
before relaunches its packed stages, with none of the checks in between.

Only calls whose every array is another library's device array (CUDA Array
Interface, or a PyTorch tensor) and whose results go to ``out=`` arrays are
replayed: NumPy arrays are copied each call, and new result arrays are new
memory each call. The key holds no array: a replay keeps nothing alive.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ._call_intake import plain_scalar, scalar_key
from .arrays import ArrayView
from .backends import Backend, LaunchConfig, NodeArguments, StageLauncher, StreamHandle
from .interop import device_array

__all__ = ["REPLAYS_KEPT", "Replay", "replay_key"]

REPLAYS_KEPT: Final = 64
"""Keys a lane remembers (all forgotten at once past this)."""


@dataclass(slots=True)
class Replay:
    """What a call of one key launches: its stream, and its stages packed (or its graph's)."""

    stream: StreamHandle
    stages: tuple[tuple[StageLauncher, Any, LaunchConfig], ...]
    """Each stage's launcher, packed arguments and geometry."""
    graph: tuple[tuple[LaunchConfig, ...], tuple[NodeArguments, ...]] | None
    """With ``device_graph=True``: the graph's geometry and arguments (the same object each
    launch, so the graph is not patched again)."""
    checked_at: int
    """The backend's :attr:`~accy_async.backends.Backend.removals` when ``stream`` was last
    seen live (nothing destroyed since: it still is)."""

    def holds(self, backend: Backend) -> bool:
        """Whether the replay's stream is still one of ``backend``'s (it may be forgotten)."""
        removals = backend.removals
        if removals == self.checked_at:
            return True
        if not backend.owns(self.stream):
            return False
        self.checked_at = removals
        return True


def replay_key(
    operands: Sequence[Any],
    results: Sequence[Any],
    stream: StreamHandle | None,
    scalars: Mapping[str, Any],
) -> tuple[object, ...] | None:
    """What decides a call on device arrays into ``results`` (``out=``); ``None`` if not one.

    Each array adds what the call reads of its CUDA Array Interface (data,
    shape, typestr, strides, stream), or a PyTorch tensor its address, size,
    dtype and stream. An array whose description cannot be read makes no
    key: the call goes the checked way, which says what is wrong with it. The
    key may still hold something unhashable (a list for a shape): whoever
    looks it up treats the ``TypeError`` as no key.
    """
    parts: list[object] = [stream, len(operands)]
    torch = sys.modules.get("torch")  # a tensor's class is loaded, so torch is imported
    tensor = None if torch is None else torch.Tensor
    try:
        for name, value in scalars.items():
            parts += (name, scalar_key(plain_scalar(value)))  # as the call takes it
        for array in (*operands, *results):
            if tensor is not None and isinstance(array, tensor):
                if not array.is_cuda:
                    return None
                device = device_array(array, "", "")
                assert device is not None
                parts += (device.address, device.size, device.dtype, device.stream, "tensor")
            elif isinstance(array, ArrayView):  # the call writes its stream: checked each time
                return None
            else:
                get = array.__cuda_array_interface__.get  # (not ``descr``: a list, unread)
                parts += (get("data"), get("shape"), get("typestr"), get("strides"), get("stream"))
    except Exception:  # noqa: BLE001 - whatever the array raises, the checked way reports it
        return None
    return tuple(parts)
