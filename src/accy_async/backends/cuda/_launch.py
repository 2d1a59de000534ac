"""Kernel launches on the CUDA backend: a loaded kernel's argument array, packed in place.

Each loaded kernel keeps one packed argument array (a ``void*`` array over an
8-byte slot per argument) that every launch refills; :class:`CudaStageLauncher`
binds it, the packer and ``cuLaunchKernel`` once per loaded kernel.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ...plan import ScalarArgument
from .._handles import BufferBinding, EventHandle, LoadedArtifact, StreamHandle
from .._launch_config import LaunchConfig
from .._launcher import StageLauncher
from ..forecast import CostModel

if TYPE_CHECKING:
    from .._health import Health
    from ..base import Backend
    from ._device import DeviceState

__all__ = ["CudaStageLauncher", "Kernel", "TableKernel", "argument_format"]

_SCALAR_CODES: Final = {
    "u32": "I4x",
    "i32": "i4x",
    "f32": "f4x",
    "u64": "Q",
    "i64": "q",
    "f64": "d",
}


class Kernel:
    """A loaded function with its reusable argument array.

    ``table`` is its argument-table variant for device graphs once made
    (:func:`~._artifacts.load_table_variants`): a :class:`TableKernel`, or the
    reason there is none (a string); ``None`` until it was tried.
    """

    __slots__ = (
        "argument_count",
        "cost",
        "formats",
        "function",
        "key",
        "launcher",
        "lock",
        "module",
        "name",
        "params",
        "pointers",
        "ptx",
        "slots",
        "table",
        "unloaded",
    )

    def __init__(
        self,
        module: Any,
        function: Any,
        argument_count: int,
        cost: CostModel,
        ptx: bytes = b"",
        name: str = "",
        key: tuple[str, int, bytes] | None = None,
    ) -> None:
        self.name = name
        self.key = key
        """``(name, argument count, image digest)``: where its module is shelved once the
        kernel is destroyed; ``None`` for a module that is unloaded instead."""
        self.ptx = ptx
        """The PTX the module was made from, where known (the table variant is made from it)."""
        self.table: TableKernel | str | None = None
        self.lock = threading.Lock()
        """Orders a table variant arriving from a worker thread with the kernel's unload."""
        self.unloaded = False
        self.cost = cost
        """What the forecast learns of this kernel's length (shared by every load of its image)."""
        self.module = module
        self.function = function
        self.argument_count = argument_count
        count = max(argument_count, 1)
        self.slots = ctypes.create_string_buffer(8 * count)
        base = ctypes.addressof(self.slots)
        self.pointers = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
        self.params = ctypes.addressof(self.pointers)
        self.formats: dict[tuple[str, ...], struct.Struct] = {}
        self.launcher: CudaStageLauncher | None = None

    def packer(self, buffer_count: int, scalar_types: tuple[str, ...]) -> struct.Struct:
        packer = self.formats.get(scalar_types)
        if packer is None:
            packer = self.formats[scalar_types] = struct.Struct(
                "<" + argument_format(buffer_count, scalar_types)
            )
        return packer


def argument_format(buffer_count: int, scalar_types: Sequence[str]) -> str:
    """The :mod:`struct` codes of a launch's arguments, an 8-byte slot each (no byte order)."""
    return "Q" * buffer_count + "".join(_SCALAR_CODES[t] for t in scalar_types)


class TableKernel:
    """A kernel's argument-table variant: its module and function (see :mod:`._table_ptx`)."""

    __slots__ = ("function", "module")

    def __init__(self, module: Any, function: Any) -> None:
        self.module = module
        self.function = function


class CudaStageLauncher(StageLauncher):
    """Packs arguments straight into the kernel's argument array and calls the driver.

    It remembers the last ``scalars`` object it saw, so a stage launched again
    with the same resolved scalars only packs buffer addresses; prepared
    arguments are the packed bytes themselves, copied in with one assignment.
    """

    __slots__ = ("_default_stream", "_device", "_health", "_kernel", "_launch", "_name", "_state")

    def __init__(
        self, backend: Backend, loaded: LoadedArtifact, device: DeviceState, health: Health
    ) -> None:
        super().__init__(backend, loaded)
        self._device = device
        self._health = health
        self._default_stream = backend.default_stream
        self._kernel: Kernel = loaded.native
        self._launch = device.launch_kernel
        self._name = loaded.artifact.spec.kernel_name
        self._state: list[Any] = [None, (), None]  # last scalars, their values, their packer

    def _pack_for(self, buffer_count: int, scalars: Sequence[ScalarArgument]) -> struct.Struct:
        state = self._state
        if scalars is not state[0]:
            state[0] = scalars
            state[1] = tuple([argument.value for argument in scalars])
            state[2] = self._kernel.packer(
                buffer_count, tuple([argument.type_name for argument in scalars])
            )
        packer: struct.Struct = state[2]
        return packer

    def __call__(
        self,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        config: LaunchConfig,
        stream: StreamHandle | None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
    ) -> None:
        """Enqueue one launch of the bound kernel."""
        self.launch_prepared(
            self._packed(buffers, scalars), config, stream, wait_events, signal_event
        )

    def launch_untraced(
        self,
        buffers: Sequence[BufferBinding],
        scalars: Sequence[ScalarArgument],
        config: LaunchConfig,
        stream: StreamHandle,
        wait_events: Sequence[EventHandle],
        signal_event: EventHandle | None,
    ) -> None:
        """One launch that no tracer records.

        For the backend's own ``_launch``: :meth:`Backend.launch` has recorded
        it already when tracing.
        """
        self.launch_prepared(
            self._packed(buffers, scalars), config, stream, wait_events, signal_event, traced=False
        )

    def _packed(self, buffers: Sequence[BufferBinding], scalars: Sequence[ScalarArgument]) -> Any:
        """The arguments packed into the kernel's own argument array (as prepared ones)."""
        kernel = self._kernel
        state = self._state
        self._pack_for(len(buffers), scalars).pack_into(
            kernel.slots, 0, *[binding.address for binding in buffers], *state[1]
        )
        return (kernel.params, None, None, state[1])

    def prepare(self, buffers: Sequence[BufferBinding], scalars: Sequence[ScalarArgument]) -> Any:
        """Argument storage of its own, and the scalar values (the forecast sizes launches by them).

        A tuple: the ``void*`` array's address, the packed slots, the array, the values.
        """
        count = max(len(buffers) + len(scalars), 1)
        packer = self._kernel.packer(
            len(buffers), tuple([argument.type_name for argument in scalars])
        )
        values = tuple([argument.value for argument in scalars])
        slots = ctypes.create_string_buffer(
            packer.pack(*[binding.address for binding in buffers], *values), 8 * count
        )
        base = ctypes.addressof(slots)
        pointers = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
        return (ctypes.addressof(pointers), slots, pointers, values)

    def launch_prepared(
        self,
        prepared: Any,
        config: LaunchConfig,
        stream: StreamHandle | None,
        wait_events: Sequence[EventHandle] = (),
        signal_event: EventHandle | None = None,
        *,
        traced: bool = True,
    ) -> None:
        """Launch with the prepared argument array: nothing is packed or copied.

        Recorded by the backend's tracer, if it has one, unless ``traced`` is
        false (the backend's own ``_launch``: :meth:`Backend.launch` records it).
        """
        if self._health.refusal is not None:
            self._health.refuse()
        if stream is None:
            stream = self._default_stream
        gx, gy, gz, bx, by, bz, shared = config.dims  # read before anything is enqueued
        tracer = self.backend.tracer if traced else None
        record = (
            None
            if tracer is None
            else tracer.begin("launch", self._name, stream.id, {"config": config})
        )
        stamping = tracer if tracer is not None and tracer.device_times else None
        try:
            device = self._device
            if wait_events:
                for event in wait_events:
                    device.wait(stream, event)
            if stamping is not None and record is not None:  # the kernel's own span
                device.trace_clock.stamp(stream.native, record, False, stamping)
            kernel = self._kernel
            (result,) = self._launch(
                kernel.function, gx, gy, gz, bx, by, bz, shared, stream.native, prepared[0], 0
            )
            if result:
                device.fail(result, f"launching {self._name}")
            device.ledgers[stream.id].enqueue(kernel.cost, (config.grid, config.block, prepared[3]))
            if stamping is not None and record is not None:
                device.trace_clock.stamp(stream.native, record, True, stamping)
            if signal_event is not None:
                device.record(signal_event, stream)
        finally:
            if tracer is not None and record is not None:
                tracer.end(record)
