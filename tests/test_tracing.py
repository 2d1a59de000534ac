"""Tracing: the exported Chrome trace loads and says what ran where, and when.

On the CPU backend (real worker threads), and on CUDA where there is a GPU
(timing events): a track per task on the host and per stream on the device,
complete events, flows from each enqueue to its run that pair up, device spans
inside their enqueue-to-resume window, no overlapping events on one track. Off
by default; NVTX ranges checked with a stub module.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.backends import BackendKind, GraphNode, Tracer
from accy_async.pipeline import (
    PipelineLaunch,
    allocate_pipeline_intermediates,
    launch_pipeline,
    load_pipeline_artifacts,
)

from .conftest import needs_gpu
from .kernels import grid_for, load

N = 100_000


async def _two_tasks_of_scans(backend: accy.Backend) -> list[np.ndarray[Any, Any]]:
    """Two tasks, each on its own stream: upload, the built-in scan, download."""
    document = library.load_builtin("prefix_sum_i32")
    got: list[np.ndarray[Any, Any]] = []
    async with await load_pipeline_artifacts(backend, document.pipeline, document.registry) as pool:

        async def one(seed: int) -> None:
            stream = backend.create_stream()
            values = np.random.default_rng(seed).integers(0, 9, N, dtype=np.int32)
            x = accy.upload(backend, values, stream=stream)
            y = backend.allocate_buffer(4 * N)
            async with await allocate_pipeline_intermediates(
                backend, document.pipeline, (p.U32(N),)
            ) as scratch:
                request = PipelineLaunch.of(
                    document,
                    operands=(x.bind("read_only"),),
                    results=(y.bind(),),
                    runtime_scalar_arguments=(p.U32(N),),
                    intermediates=scratch,
                    artifacts=pool,
                    stream=stream,
                    device_graph=False,  # each stage its own span (the second would be a graph)
                )
                await launch_pipeline(backend, request)
                await accy.wait_stream(backend, stream)
                got.append(await accy.download(backend, y, np.int32, N, stream=stream))
                assert np.array_equal(got[-1], np.cumsum(values, dtype=np.int32))
            backend.destroy_all([x, y, stream])

        async with anyio.create_task_group() as group:
            group.start_soon(one, 1)
            group.start_soon(one, 2)
    return got


def _by_kind(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        kinds[event["ph"]].append(event)
    return kinds


@pytest.mark.parametrize(
    ("kind", "slack_us"),
    [
        ("cpu", 0.0),
        # CUDA's device times come from timing events, put on the host's clock through one
        # reference event: good to a few microseconds
        pytest.param("cuda", 20.0, marks=[pytest.mark.gpu, needs_gpu]),
    ],
)
async def test_a_trace_has_its_tracks_flows_and_spans_in_order(
    tmp_path: Path, kind: BackendKind, slack_us: float
) -> None:
    async with accy.open_backend(kind) as backend:
        with accy.trace(backend) as tracer:
            await _two_tasks_of_scans(backend)
        assert backend.tracer is None
        path = tmp_path / "trace.json"
        tracer.write(path)
    slack_ns = slack_us * 1000
    document = json.loads(path.read_text())
    events = document["traceEvents"]
    kinds = _by_kind(events)
    names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in kinds["M"] if e["name"] == "thread_name"
    }
    processes = {e["pid"]: e["args"]["name"] for e in kinds["M"] if e["name"] == "process_name"}
    assert processes[1] == "host" and processes[2].startswith(f"{kind} backend")
    complete = kinds["X"]
    assert complete and all(
        {"name", "ph", "pid", "tid", "ts", "dur"} <= e.keys() and e["dur"] >= 0 for e in complete
    )
    host = [e for e in complete if e["pid"] == 1]
    device = [e for e in complete if e["pid"] == 2]
    # a track per task (two scan tasks) and per stream (two streams), each named
    assert len({e["tid"] for e in host if e["cat"] == "launch"}) == 2
    stream_tracks = {e["tid"] for e in device if e["cat"] == "launch"}
    assert len(stream_tracks) == 2
    assert all((2, tid) in names for tid in stream_tracks)
    assert all((1, e["tid"]) in names for e in host)
    launches = [e for e in device if e["cat"] == "launch"]
    stages = len(library.load_builtin("prefix_sum_i32").pipeline.stages)
    assert len(launches) == 2 * stages  # every stage of two tasks
    assert {e["cat"] for e in host} >= {"launch", "write", "read", "wait"}
    # flows pair up: every start on the host has one finish on the device
    starts = {e["id"]: e for e in kinds["s"]}
    finishes = {e["id"]: e for e in kinds["f"]}
    assert starts and starts.keys() == finishes.keys()
    assert all(e["pid"] == 1 for e in starts.values())
    assert all(e["pid"] == 2 and e["bp"] == "e" for e in finishes.values())
    for key, start in starts.items():  # the device ran it after it was enqueued
        assert finishes[key]["ts"] >= start["ts"] - slack_us
    # no overlapping events on one track
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in complete:
        tracks[event["pid"], event["tid"]].append(event)
    for track, spans in tracks.items():
        spans.sort(key=lambda e: e["ts"])
        for before, after in itertools.pairwise(spans):
            assert after["ts"] >= before["ts"] + before["dur"] - 1e-3, track
    # each device span lies inside its task's window: after its enqueue, before the task
    # resumed from its last wait
    for record in tracer.records:
        if record.device_start_ns is None or record.device_end_ns is None:
            continue
        assert record.device_start_ns >= record.enqueue_start_ns - slack_ns
        resumed = max(
            r.enqueue_end_ns for r in tracer.records if r.kind == "wait" and r.task == record.task
        )
        assert record.device_end_ns <= resumed + slack_ns


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpu])])
async def test_host_only_tracing_records_no_device_times(tmp_path: Path, kind: BackendKind) -> None:
    async with accy.open_backend(kind) as backend:
        with accy.trace(backend, device_times=False) as tracer:
            await _two_tasks_of_scans(backend)
        path = tmp_path / "trace.json"
        tracer.write(path)
    assert {r.kind for r in tracer.records} >= {"launch", "write", "read", "wait"}
    assert all(r.device_start_ns is None and r.device_end_ns is None for r in tracer.records)
    kinds = _by_kind(json.loads(path.read_text())["traceEvents"])
    assert kinds["X"] and all(e["pid"] == 1 for e in kinds["X"])  # the host's spans only
    assert not kinds["s"] and not kinds["f"]


@pytest.mark.gpu
@needs_gpu
async def test_a_long_cuda_trace_resolves_every_launch_in_stream_order() -> None:
    """Thousands of traced launches before one export: the clock recycles the events the
    device has passed (with a backlog still queued), and every launch gets its device span."""
    launches = 3000
    async with accy.open_backend("cuda") as backend:
        kernel = await load(backend, "add_one_f32")
        n = 1 << 20
        a, b = backend.allocate_buffer(4 * n), backend.allocate_buffer(4 * n)
        backend.fill_buffer(a, 0)
        streams = [backend.create_stream(), backend.create_stream()]
        config = accy.LaunchConfig(*grid_for(n))
        with accy.trace(backend) as tracer:
            for i in range(launches):
                backend.launch(
                    kernel,
                    [b.bind(), a.bind("read_only")],
                    [accy.U32(n)],
                    config,
                    stream=streams[i % 2],
                )
            for stream in streams:
                await accy.wait_stream(backend, stream)
        tracer.chrome_trace()  # resolves the stamps not yet resolved
        records = [r for r in tracer.records if r.kind == "launch"]
        assert len(records) == launches
        for stream in streams:
            mine = [r for r in records if r.stream == stream.id]
            assert len(mine) == launches // 2
            previous_end = 0
            for record in mine:
                assert record.device_start_ns is not None and record.device_end_ns is not None
                assert record.device_start_ns <= record.device_end_ns
                assert record.device_start_ns >= previous_end - 2_000  # in order on the stream
                previous_end = record.device_end_ns
        backend.destroy_all([kernel, a, b, *streams])


async def test_nothing_is_recorded_outside_the_block_and_one_trace_at_a_time() -> None:
    async with accy.open_backend("recording") as backend:
        buffer = backend.allocate_buffer(64)
        with accy.trace(backend) as tracer:
            backend.fill_buffer(buffer, 7)
            with (
                pytest.raises(accy.UnsupportedOperation, match="already being traced"),
                accy.trace(backend),
            ):
                pass
            assert backend.tracer is tracer
        backend.fill_buffer(buffer, 8)
        await accy.wait_stream(backend)
        assert [(r.kind, r.device_start_ns is not None) for r in tracer.records] == [("fill", True)]
        backend.destroy(buffer)


async def test_a_graph_launch_is_one_event_on_its_stream() -> None:
    async with accy.open_backend("cpu") as backend:
        kernel = await load(backend, "add_one_f32")
        config = accy.LaunchConfig(*grid_for(1024))
        graph = backend.instantiate_graph(
            [GraphNode(kernel, config), GraphNode(kernel, config, after=(0,))]
        )
        a, b = backend.allocate_buffer(4096), backend.allocate_buffer(4096)
        backend.fill_buffer(a, 0)  # not whatever the allocation held (a NaN warns in the add)
        n = accy.U32(1024)
        with accy.trace(backend) as tracer:
            backend.launch_graph_exec(
                graph, [([b.bind(), a.bind()], [n]), ([a.bind(), b.bind()], [n])]
            )
            await accy.wait_stream(backend)
        (launch,) = [r for r in tracer.records if r.kind == "graph"]
        assert launch.args is not None and launch.args["nodes"] == ["add_one_f32", "add_one_f32"]
        assert launch.device_start_ns is not None and launch.device_end_ns is not None
        backend.destroy_all([graph, a, b, kernel])


class _StubNvtx:
    """What the tracer needs of the ``nvtx`` package, counting ranges."""

    def __init__(self) -> None:
        self.open: dict[int, tuple[str, str]] = {}
        self.closed: list[tuple[str, str]] = []

    def start_range(self, message: str, domain: str, category: str) -> int:
        handle = len(self.open) + len(self.closed) + 1
        self.open[handle] = (domain, message)
        del category
        return handle

    def end_range(self, handle: int) -> None:
        self.closed.append(self.open.pop(handle))


async def test_nvtx_ranges_start_and_end_in_the_accy_domain() -> None:
    stub = _StubNvtx()
    async with accy.open_backend("recording") as backend:
        buffer = backend.allocate_buffer(64)
        backend.tracer = Tracer("stub", nvtx_module=stub)
        try:
            backend.fill_buffer(buffer, 1)
            await accy.wait_stream(backend)
        finally:
            backend.tracer = None
        backend.destroy(buffer)
    assert not stub.open
    assert stub.closed == [("accy", "fill"), ("accy", "wait")]  # few distinct messages


async def test_nvtx_without_the_package_is_refused_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_nvtx(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "nvtx":
            raise ImportError("no nvtx here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nvtx)
    async with accy.open_backend("recording") as backend:
        with (
            pytest.raises(accy.RuntimeUnavailable, match="pip install"),
            accy.trace(backend, nvtx=True),
        ):
            pass
        assert backend.tracer is None


async def test_a_failed_enqueue_and_a_cancelled_wait_say_so() -> None:
    backend = accy.RecordingBackend(completion="manual")
    async with backend:
        buffer = backend.allocate_buffer(64)
        event = backend.create_event()
        backend.inject_fault("fill")
        with accy.trace(backend) as tracer:
            with pytest.raises(accy.UnsupportedOperation):  # a fill's injected fault
                backend.fill_buffer(buffer, 1)
            backend.record_event(event)
            with anyio.move_on_after(0.01):
                await accy.wait_event(backend, event)
        backend.complete_all()
        failed, waited = tracer.records
        assert failed.kind == "fill" and failed.args == {
            "bytes": 64,
            "error": "UnsupportedOperation",
        }
        assert failed.device_end_ns is None
        assert waited.kind == "wait" and waited.args is not None
        assert waited.args["error"] in ("Cancelled", "CancelledError")
        backend.destroy_all([buffer, event])
