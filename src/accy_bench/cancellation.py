"""The cancellation section: how soon each way of waiting gives control back when cancelled.

Another task cancels the caller's scope 5 ms into a 50 ms kernel; the row is the
microseconds until ``wait_event``, ``wait_stream``, ``download`` or
``launch_pipeline`` has returned (what the device still uses goes to deferred
release), beside the same cancellation of a plain ``anyio.sleep`` (the loop's and
AnyIO's own share of it), and the worst lateness of a 1 ms heartbeat on the same loop over the
row's trials: the driver holds launches, records and allocations while another
thread loads a module or frees memory behind a running kernel, and a loop held
there before the cancellation arrives would not show in the row's latencies.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Final

import anyio
import numpy as np

from accy_async import (
    U32,
    U64,
    PipelineLaunch,
    choose_format,
    download,
    launch_pipeline,
    wait_event,
    wait_stream,
)
from accy_async.library import load_builtin

from .latency import Heartbeat
from .rig import run_on
from .stamps import ONE, load_spin_stamp
from .stats import Samples, Section, guarded

__all__ = ["cancellation_section"]

_CANCELLED_WAYS: Final = ("wait_event", "wait_stream", "download", "launch_pipeline")
"""The ways of waiting cancelled; the pipeline owns its scratch and kernels (no pool given)."""

_BASELINE: Final = "anyio.sleep(1), cancelled: the loop's own floor"
"""The same cancellation of a plain sleep: what the loop and AnyIO's cancel scopes cost."""

_CANCEL_AFTER_S: Final = 5e-3
_KERNEL_NS: Final = 50_000_000
_CANCELLATION_WORKLOAD: Final = "cancelled 5 ms into a 50 ms kernel"


async def _cancellation_rows(library: str, trials: int) -> dict[str, Any]:
    """Cancel each way of waiting 5 ms into a 50 ms kernel: how soon control comes back."""
    from accy_async.backends.cuda import CudaBackend

    rows: dict[str, Any] = {}
    backend = CudaBackend()
    try:
        document = load_builtin("prefix_sum_i32")
        fmt = choose_format(backend, document)
        loaded = await load_spin_stamp(backend)
        stamp, x, y = (backend.allocate_buffer(4096) for _ in range(3))
        stream, event = backend.create_stream(), backend.create_event()
        request = PipelineLaunch(
            pipeline=document.pipeline,
            registry=document.registry,
            format=fmt,
            operands=[x.bind("read_only")],
            results=[y.bind()],
            runtime_scalar_arguments=(U32(1024),),
            stream=stream,
        )
        ways: dict[str, Callable[[], Awaitable[Any]]] = {
            _BASELINE: lambda: anyio.sleep(1),
            "wait_event": lambda: wait_event(backend, event),
            "wait_stream": lambda: wait_stream(backend, stream),
            "download": lambda: download(backend, y, np.int32, 1, stream=stream),
            "launch_pipeline": lambda: launch_pipeline(backend, request),
        }
        for way, wait in ways.items():
            samples = Samples()
            heartbeat = Heartbeat()  # a loop held up by the driver shows here, not in the row
            async with anyio.create_task_group() as beating:
                beating.start_soon(heartbeat.run)
                for _ in range(trials):
                    backend.launch(loaded, [stamp.bind()], [U64(_KERNEL_NS)], ONE, stream=stream)
                    backend.record_event(event, stream)
                    cancelled_at = [0.0]
                    with anyio.CancelScope() as scope:
                        async with anyio.create_task_group() as group:
                            group.start_soon(_cancel_later, scope, cancelled_at)
                            await wait()
                    returned = time.perf_counter()
                    samples.add(
                        (returned - cancelled_at[0]) * 1e6, wrong=not scope.cancelled_caught
                    )
                    await wait_stream(backend, stream)
                beating.cancel_scope.cancel()
            rows[_row_name(way, library)] = samples.summary(heartbeat.worst)
        backend.destroy_all([loaded, stamp, x, y, stream, event])
    finally:
        await backend.aclose()
    return rows


def _row_name(way: str, library: str) -> str:
    """A row's name: ``accy wait_event, cancelled (trio)``, or the baseline's on ``library``."""
    if way == _BASELINE:
        return f"{way} ({library})"
    return f"accy {way}, cancelled ({library})"


async def _cancel_later(scope: anyio.CancelScope, cancelled_at: list[float]) -> None:
    await anyio.sleep(_CANCEL_AFTER_S)
    cancelled_at[0] = time.perf_counter()
    scope.cancel()


def cancellation_section(libraries: Sequence[str], trials: int) -> Section:
    """Each way of waiting, cancelled ``trials`` times, on each library's event loop in turn."""
    rows: dict[str, Any] = {}
    for library in libraries:
        print(f"cancellation on {library}", file=sys.stderr, flush=True)
        measure = partial(_cancellation_rows, library, trials)
        names = [_row_name(way, library) for way in (_BASELINE, *_CANCELLED_WAYS)]
        shape = {_CANCELLATION_WORKLOAD: names}
        part = run_on(library, guarded, shape, _wrap_rows(measure))
        rows.update(part[_CANCELLATION_WORKLOAD])
    return {_CANCELLATION_WORKLOAD: rows}


def _wrap_rows(
    measure: Callable[[], Awaitable[dict[str, Any]]],
) -> Callable[[], Awaitable[Section]]:
    async def section() -> Section:
        return {_CANCELLATION_WORKLOAD: await measure()}

    return section
