"""Tracing a block of work: ``with accy.trace(backend) as tracer: ...; tracer.write(path)``.

Within the block every launch, graph launch, copy, fill and read the backend
enqueues, and every ``wait_event`` / ``wait_stream`` on it, is recorded (see
:class:`~accy_async.backends.Tracer`); outside it the backend records nothing
and pays one attribute check per call. Export once the traced work has
completed (await it): the device's times are stamped as it runs.

Open the JSON in https://ui.perfetto.dev (or ``chrome://tracing``): the host
process has a track per task (its enqueues and waits), the device process a
track per stream (what ran there, when), and an arrow joins each enqueue to
its run. On the CPU backend the device's times are its stream workers'
(the host's clock); on CUDA, timing events recorded on the stream before and
after each operation, placed on the host's clock through one reference event
(good to a few microseconds) and read when the trace is exported: export
after awaiting the work, and before closing the backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .backends import Backend, Tracer
from .errors import UnsupportedOperation

__all__ = ["trace"]


@contextlib.contextmanager
def trace(backend: Backend, *, nvtx: bool = False, device_times: bool = True) -> Iterator[Tracer]:
    """Record what ``backend`` enqueues and waits for within the block; yields the tracer.

    With ``nvtx`` each host span is also an NVTX range in the ``accy`` domain
    (needs the optional ``nvtx`` package), for Nsight Systems. With
    ``device_times=False`` the trace keeps the host's side only (enqueue spans,
    waits): on CUDA a traced launch then records no timing events, which is
    most of tracing's cost there (two ``cuEventRecord`` calls per operation).
    One trace at a time per backend
    (:class:`~accy_async.errors.UnsupportedOperation` for a second).
    """
    if backend.tracer is not None:
        raise UnsupportedOperation(f"the {backend.kind} backend is already being traced")
    tracer = Tracer(f"{backend.kind} backend: {backend.name}", nvtx=nvtx, device_times=device_times)
    backend.tracer = tracer
    try:
        yield tracer
    finally:
        backend.tracer = None
