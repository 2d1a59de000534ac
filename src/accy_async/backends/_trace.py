"""Tracing: what was enqueued, when it ran on the device, and which task waited for it.

A :class:`Tracer` is off unless a backend holds one (:func:`accy_async.trace`
sets and clears it); every traced call checks one attribute when tracing is
off. When on, each launch, copy, fill, read and graph launch becomes a
:class:`TraceRecord`: the calling task, the host's enqueue span, the stream,
and the device's start and end where the backend can tell (the CPU backend's
stream worker stamps them on its own clock, which is the host's; CUDA records
a timing event on the stream before and after the work, resolved when the
trace is exported; the recording backend, which runs nothing, takes its
enqueue times). With a tracer made with ``device_times=False`` no backend stamps
the device's times: host spans only, at a fraction of the cost on CUDA. Waits
record when the task began waiting and when it resumed.

:meth:`Tracer.chrome_trace` exports the Chrome trace-event format that Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` load: one process for the host with
a track per task, one process for the device with a track per stream, ``X``
(complete) events, ``thread_name`` metadata, and a flow arrow from each
enqueue to its device span. With ``nvtx=True`` each host span is also an NVTX
range (start/end ranges, which survive ``await``) in the ``accy`` domain, for
Nsight Systems; that needs the optional ``nvtx`` package.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from ..errors import RuntimeUnavailable

__all__ = ["TraceRecord", "Tracer"]

_HOST_PID: Final = 1
_DEVICE_PID: Final = 2


class TraceRecord:
    """One traced operation: enqueued by a task on a stream, run on the device.

    ``kind`` is ``launch``, ``graph``, ``write``, ``read``, ``copy``, ``fill``
    or ``wait``; ``stream`` the stream handle's id (-1 for a wait); ``task``
    the enqueuing task's number in :attr:`Tracer.task_names`; times are
    ``time.perf_counter_ns()`` (the device's ``None`` where the backend cannot
    tell); ``args`` what the exported event shows besides.
    """

    __slots__ = (
        "args",
        "device_end_ns",
        "device_start_ns",
        "enqueue_end_ns",
        "enqueue_start_ns",
        "kind",
        "name",
        "nvtx_range",
        "stream",
        "task",
    )

    def __init__(
        self,
        kind: str,
        name: str,
        stream: int,
        task: int,
        enqueue_start_ns: int,
        args: dict[str, Any] | None = None,
    ) -> None:
        self.kind = kind
        self.name = name
        self.stream = stream
        self.task = task
        self.enqueue_start_ns = enqueue_start_ns
        self.enqueue_end_ns = 0
        self.device_start_ns: int | None = None
        self.device_end_ns: int | None = None
        self.args = args
        self.nvtx_range: Any = None

    def failed(self, error: BaseException) -> None:
        """Note that the operation raised ``error`` (a failed enqueue, a cancelled wait)."""
        self.args = {**(self.args or {}), "error": type(error).__name__}


class Tracer:
    """The records of one traced stretch of a backend's life; see the module docstring.

    Records are added from the event loop's thread (or any thread: a list's
    append is atomic) and device times stamped from the backend's workers.
    """

    def __init__(
        self,
        device_name: str = "device",
        *,
        nvtx: bool = False,
        nvtx_module: Any = None,
        device_times: bool = True,
    ) -> None:
        self.device_name = device_name
        self.device_times = device_times
        """Whether backends stamp the device's start and end of each operation.

        Off, records keep the host's side only (enqueue spans, waits), and a
        traced CUDA launch records no timing events: the cheapest trace."""
        self.records: list[TraceRecord] = []
        self.task_names: dict[int, str] = {0: "host"}
        """Each task seen, by the number records carry (0: outside any task)."""
        self._tasks: list[object] = []
        """The tasks seen, kept while tracing: no other task can take one's number."""
        self._last_task: object = None
        self._resolvers: list[Callable[[], None]] = []
        """Called before an export: backends whose device times arrive late fill them in."""
        self._nvtx: Any = None
        if nvtx or nvtx_module is not None:
            self._nvtx = nvtx_module if nvtx_module is not None else _import_nvtx()
        self._trio = _running_trio()

    # ----- recording -------------------------------------------------------------------------

    def begin(
        self, kind: str, name: str, stream: int, args: dict[str, Any] | None = None
    ) -> TraceRecord:
        """Start a record now, on the calling task's behalf."""
        record = TraceRecord(kind, name, stream, self._current_task(), time.perf_counter_ns(), args)
        if self._nvtx is not None:  # few distinct messages: NVTX registers each one
            message = f"{kind} {name}" if kind in ("launch", "graph") else kind
            record.nvtx_range = self._nvtx.start_range(
                message=message, domain="accy", category=kind
            )
        self.records.append(record)
        return record

    def end(self, record: TraceRecord) -> None:
        """The host side of ``record`` is over (enqueued; for a wait, the task resumed)."""
        record.enqueue_end_ns = time.perf_counter_ns()
        if record.nvtx_range is not None:
            self._nvtx.end_range(record.nvtx_range)
            record.nvtx_range = None

    def add_resolver(self, resolve: Callable[[], None]) -> None:
        """Have ``resolve()`` run before each export (once, however often it is added)."""
        if resolve not in self._resolvers:
            self._resolvers.append(resolve)

    @staticmethod
    def stamp(record: TraceRecord, end: bool) -> None:
        """Note now as the device's start (or end) of ``record``: from a stream's worker."""
        now = time.perf_counter_ns()
        if end:
            record.device_end_ns = now
        else:
            record.device_start_ns = now

    def _current_task(self) -> int:
        """The calling task's number (0 outside any task: a thread, a sync caller)."""
        try:
            task: Any = _trio_current_task() if self._trio else asyncio.current_task()
        except RuntimeError:  # no asyncio loop here: trio's, if the tracer began outside one
            if self._trio or not _running_trio():
                return 0
            self._trio = True
            task = _trio_current_task()
        if task is None:
            return 0
        number = id(task)
        if task is self._last_task:  # a task launching many times in a row
            return number
        self._last_task = task
        if number not in self.task_names:
            name = task.name if self._trio else task.get_name()
            self.task_names[number] = f"{name} ({len(self._tasks) + 1})"
            self._tasks.append(task)
        return number

    # ----- export ----------------------------------------------------------------------------

    def chrome_trace(self) -> dict[str, Any]:
        """The records as a Chrome trace-event document (see the module docstring).

        Device times that have arrived since the last export are filled in first
        (on CUDA: the timing events of work that has completed).
        """
        for resolve in self._resolvers:
            resolve()
        records = list(self.records)
        origin = min((r.enqueue_start_ns for r in records), default=0)

        def us(ns: int) -> float:
            return (ns - origin) / 1000.0

        events: list[dict[str, Any]] = [
            _meta("process_name", _HOST_PID, 0, "host"),
            _meta("process_name", _DEVICE_PID, 0, self.device_name),
        ]
        tasks: dict[int, int] = {}
        streams: set[int] = set()
        for index, record in enumerate(records):
            tid = tasks.setdefault(record.task, len(tasks) + 1)
            args = _exported_args(record)
            end_ns = max(record.enqueue_end_ns, record.enqueue_start_ns)
            host = {
                "name": f"{record.kind} {record.name}",
                "cat": record.kind,
                "ph": "X",
                "pid": _HOST_PID,
                "tid": tid,
                "ts": us(record.enqueue_start_ns),
                "dur": (end_ns - record.enqueue_start_ns) / 1000.0,
                "args": {"stream": record.stream, **args},
            }
            events.append(host)
            if record.device_start_ns is None or record.device_end_ns is None:
                continue
            streams.add(record.stream)
            events.append(
                {
                    "name": record.name,
                    "cat": record.kind,
                    "ph": "X",
                    "pid": _DEVICE_PID,
                    "tid": record.stream,
                    "ts": us(record.device_start_ns),
                    "dur": max(record.device_end_ns - record.device_start_ns, 0) / 1000.0,
                    "args": {"task": self.task_names.get(record.task, "?"), **args},
                }
            )
            flow = {"name": "enqueue", "cat": "flow", "id": index}
            events.append(
                {**flow, "ph": "s", "pid": _HOST_PID, "tid": tid, "ts": us(record.enqueue_start_ns)}
            )
            events.append(
                {
                    **flow,
                    "ph": "f",
                    "bp": "e",
                    "pid": _DEVICE_PID,
                    "tid": record.stream,
                    "ts": us(record.device_start_ns),
                }
            )
        for task, tid in tasks.items():
            name = self.task_names.get(task, "?")
            events.append(_meta("thread_name", _HOST_PID, tid, f"task {name}"))
        events.extend(
            _meta("thread_name", _DEVICE_PID, stream, f"stream {stream}")
            for stream in sorted(streams)
        )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> None:
        """Write :meth:`chrome_trace` as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.chrome_trace()))


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {"name": value}}


def _exported_args(record: TraceRecord) -> dict[str, Any]:
    """``record.args`` as JSON takes them (a launch's ``LaunchConfig`` as grid and block)."""
    args = record.args
    if not args:
        return {}
    config = args.get("config")
    if config is None:
        return args
    rest = {key: value for key, value in args.items() if key != "config"}
    return {"grid": list(config.grid), "block": list(config.block), **rest}


def _running_trio() -> bool:
    """Whether the caller runs under trio (else asyncio, or no loop at all)."""
    trio = sys.modules.get("trio")  # not imported: not running
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


def _trio_current_task() -> Any:
    import trio

    return trio.lowlevel.current_task()


def _import_nvtx() -> Any:
    try:
        import nvtx  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise RuntimeUnavailable(
            "NVTX ranges need the nvtx package: pip install 'accy-async[nvtx]'"
        ) from exc
    return nvtx
