"""What only a GPU can show: NVRTC, PTX and cubin payloads, faults, scale. ``-m gpu``."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.backends import GraphNode
from accy_async.backends.cuda import CudaBackend
from accy_async.pipeline import PipelineLaunch, launch_pipeline

from .conftest import needs_gpu
from .kernels import KERNELS, grid_for, spec

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.fixture
async def cuda() -> AsyncIterator[accy.Backend]:
    async with accy.open_backend("cuda") as backend:
        yield backend


async def test_auto_picks_cuda_here() -> None:
    kind, reason = accy.auto_backend_choice()
    assert kind == "cuda", reason
    async with accy.open_backend("auto") as backend:
        assert backend.kind == "cuda"


async def test_nvrtc_errors_carry_the_compile_log(cuda: accy.Backend) -> None:
    broken = p.ArtifactSpec(
        kernel_name="broken",
        format=p.ArtifactFormat.CUDA_SOURCE,
        payload=p.TextPayload('extern "C" __global__ void broken() { x; }'),
        argument_count=0,
    )
    with pytest.raises(accy.CompilationError) as caught:
        await cuda.create_artifact(broken)
    assert 'identifier "x" is undefined' in caught.value.log


async def test_ptx_and_cubin_payloads_load_and_run(cuda: accy.Backend) -> None:
    from accy_async.backends.cuda.nvrtc import compile_source

    assert isinstance(cuda, accy.backends.cuda.CudaBackend)
    major, minor = cuda.compute_capability
    source = KERNELS["iota_f32"][2]
    cubin = compile_source(source, "iota_f32", (), (major, minor))
    assert cubin.kind == "cubin"
    from accy_async.backends.cuda import nvrtc as nvrtc_module

    ptx = nvrtc_module._compile(source, "iota_f32", (), f"-arch=compute_{major}{minor}", "ptx")
    n = 1000
    for fmt, payload in (
        (p.ArtifactFormat.CUDA_CUBIN, p.BinaryPayload(cubin.image)),
        (p.ArtifactFormat.CUDA_PTX, p.TextPayload(ptx.image.decode().rstrip("\0"))),
    ):
        loaded = await cuda.load_artifact(
            await cuda.create_artifact(spec(cuda, "iota_f32", format=fmt, payload=payload))
        )
        out = cuda.allocate_buffer(4 * n)
        grid, block = grid_for(n)
        cuda.launch(loaded, [out.bind()], [p.U32(n), p.F32(2.0)], accy.LaunchConfig(grid, block))
        got = await accy.download(cuda, out, np.float32, n)
        np.testing.assert_array_equal(got, 2.0 + np.arange(n, dtype=np.float32))
        cuda.destroy_all([loaded, out])


async def test_graph_nodes_of_a_cubin_are_patched_by_the_driver_and_compute_the_same(
    cuda: accy.Backend,
) -> None:
    # A cubin carries no PTX, so no argument-table variant: its nodes stay patched.
    from accy_async.backends.cuda.nvrtc import compile_source

    assert isinstance(cuda, CudaBackend)
    cubin = compile_source(KERNELS["add_one_f32"][2], "add_one_f32", (), cuda.compute_capability)
    loaded = await cuda.load_artifact(
        await cuda.create_artifact(
            spec(cuda, "add_one_f32", format=p.ArtifactFormat.CUDA_CUBIN,
                 payload=p.BinaryPayload(cubin.image))
        )
    )  # fmt: skip
    source = await cuda.load_artifact(await cuda.create_artifact(spec(cuda, "add_one_f32")))
    await cuda.prepare_graph_kernels([loaded, source])
    assert "without PTX" in loaded.native.table
    n = 1000
    config = accy.LaunchConfig(*grid_for(n))
    graph = cuda.instantiate_graph(
        [GraphNode(loaded, config), GraphNode(source, config, after=(0,))]
    )
    assert [node.table_offset >= 0 for node in graph.native.nodes] == [False, True]
    values = np.arange(n, dtype=np.float32)
    inputs = [accy.upload(cuda, values * (turn + 1)) for turn in range(3)]
    middles = [cuda.allocate_buffer(4 * n) for _ in range(3)]
    outs = [cuda.allocate_buffer(4 * n) for _ in range(3)]
    for x, middle, out in zip(inputs, middles, outs, strict=True):  # new buffers each launch
        cuda.launch_graph_exec(
            graph,
            [([middle.bind(), x.bind()], [p.U32(n)]), ([out.bind(), middle.bind()], [p.U32(n)])],
        )
    for turn, out in enumerate(outs):
        np.testing.assert_array_equal(
            await accy.download(cuda, out, np.float32, n), values * (turn + 1) + 2
        )
    cuda.destroy_all([graph, *inputs, *middles, *outs, loaded, source])


async def test_a_prepare_cancelled_while_the_driver_compiles_leaves_one_variant(
    cuda: accy.Backend,
) -> None:
    # A name of its own keeps the driver's JIT cache cold, so the cancel lands mid-compile;
    # the abandoned worker and the retry each make a variant, and the kernel keeps one.
    from accy_async.backends.cuda._launch import TableKernel

    name = f"add_one_{random.randrange(1 << 40):x}"
    source = KERNELS["add_one_f32"][2].replace("add_one_f32", name)
    kernel = await cuda.load_artifact(
        await cuda.create_artifact(
            spec(cuda, "add_one_f32", kernel_name=name, payload=p.TextPayload(source))
        )
    )
    with anyio.move_on_after(0.001):
        await cuda.prepare_graph_kernels([kernel])
    await cuda.prepare_graph_kernels([kernel])
    assert isinstance(kernel.native.table, TableKernel)
    cuda.destroy(kernel)


async def test_a_missing_kernel_name_is_an_invalid_artifact(cuda: accy.Backend) -> None:
    if os.environ.get("ACCY_UNDER_SANITIZER"):
        pytest.skip("the planted failed lookup would be reported by the sanitizer")
    with pytest.raises(accy.InvalidArtifact, match="no kernel named"):
        await cuda.load_artifact(
            await cuda.create_artifact(spec(cuda, "iota_f32", kernel_name="not_there"))
        )


async def test_prefix_sum_of_a_hundred_million(cuda: accy.Backend) -> None:
    n = 10**8
    values = np.random.default_rng(3).integers(-1000, 1000, n, dtype=np.int32)
    document = library.load_builtin("prefix_sum_i32")
    source = accy.upload(cuda, values)
    result = cuda.allocate_buffer(4 * n)
    await launch_pipeline(
        cuda,
        PipelineLaunch(
            pipeline=document.pipeline,
            registry=document.registry,
            format=p.ArtifactFormat.CUDA_SOURCE,
            operands=[source.bind("read_only")],
            results=[result.bind()],
            runtime_scalar_arguments=(p.U32(n),),
        ),
    )
    got = await accy.download(cuda, result, np.int32, n)
    np.testing.assert_array_equal(got, np.cumsum(values, dtype=np.int32))
    cuda.destroy_all([source, result])


async def test_ten_thousand_concurrent_waits_keep_the_loop_free(cuda: accy.Backend) -> None:
    slow = await cuda.load_artifact(await cuda.create_artifact(spec(cuda, "slow_fill_f32")))
    buffer = cuda.allocate_buffer(64)
    streams = [cuda.create_stream() for _ in range(4)]
    events = [cuda.create_event() for _ in range(10_000)]
    for stream in streams:  # two seconds: long enough to park all 10,000 waiters first
        cuda.launch(
            slow,
            [buffer.bind()],
            [p.U32(1), p.F32(1), p.U64(2_000_000_000)],
            accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
            stream=stream,
        )
    for index, event in enumerate(events):
        cuda.record_event(event, streams[index % 4])
    completed = 0
    worst = 0.0
    done = anyio.Event()

    async def waiter(event: accy.EventHandle) -> None:
        nonlocal completed
        await accy.wait_event(cuda, event)
        completed += 1
        if completed == len(events):
            done.set()

    async def heartbeat() -> None:
        nonlocal worst
        while True:
            start = time.perf_counter()
            await anyio.sleep(0.001)
            worst = max(worst, time.perf_counter() - start - 0.001)

    gc.collect()
    gc.freeze()
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for event in events:
                    group.start_soon(waiter, event)
                await anyio.sleep(0.01)
                assert completed == 0
                async with anyio.create_task_group() as beat:
                    beat.start_soon(heartbeat)
                    await done.wait()
                    beat.cancel_scope.cancel()
    finally:
        gc.unfreeze()
    assert completed == 10_000
    assert worst < 0.010, f"worst heartbeat lag {worst * 1e3:.1f} ms"
    cuda.destroy_all([slow, buffer, *streams, *events])


async def test_anticipated_waits_learn_the_duration_and_leave_nothing_behind(
    cuda: accy.Backend,
) -> None:
    assert isinstance(cuda, CudaBackend)
    slow = await cuda.load_artifact(await cuda.create_artifact(spec(cuda, "slow_fill_f32")))
    buffer = cuda.allocate_buffer(64)
    stream, event = cuda.create_stream(), cuda.create_event()

    def launch(nanoseconds: int) -> None:
        cuda.launch(
            slow,
            [buffer.bind()],
            [p.U32(1), p.F32(1), p.U64(nanoseconds)],
            accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
            stream=stream,
        )

    for _ in range(10):
        launch(2_000_000)
        cuda.record_event(event, stream)
        await accy.wait_event(cuda, event)
        assert cuda.query_event(event)
    launch(2_000_000)
    cuda.record_event(event, stream)
    expected = cuda.anticipate(event)
    assert expected is not None and 1.5e-3 < expected.due - time.perf_counter() < 2.5e-3
    await accy.wait_event(cuda, event)
    for _ in range(10):  # stream waits (what launch_pipeline awaits) are anticipated too
        launch(2_000_000)
        await accy.wait_stream(cuda, stream)
        assert cuda.query_stream(stream)
    mark = cuda.mark_stream(stream)
    assert mark is not None and mark.query()
    mark.release()

    pool = cuda.idle_markers
    launch(100_000_000)
    with anyio.move_on_after(0.02) as scope:  # cancelled while pending: the marker is not lost
        await accy.wait_stream(cuda, stream)
    assert scope.cancelled_caught
    await accy.wait_stream(cuda, stream)
    with anyio.fail_after(5):
        while cuda.watched_completions or cuda.idle_markers < pool:  # noqa: ASYNC110
            await anyio.sleep(0.001)  # the reactor's thread recycles the marker
    cuda.destroy_all([slow, buffer, stream, event])


async def test_a_cancelled_load_gives_control_back_at_once(cuda: accy.Backend) -> None:
    """Loading a module takes milliseconds in a worker thread; a cancelled caller does not wait
    for it (the thread loads nothing, or unloads the module it made), and the backend goes on
    working."""
    assert isinstance(cuda, CudaBackend)
    cuda._device_state.shelf.capacity = 0  # every load a real one: none comes from the shelf
    artifact = await cuda.create_artifact(spec(cuda, "slow_fill_f32"))
    live = dict(cuda.live_objects())
    for _ in range(5):
        start = time.perf_counter()
        with anyio.move_on_after(20e-6) as scope:
            loaded = await cuda.load_artifact(artifact)
            cuda.destroy(loaded)  # the load won the race: nothing to test this time
        assert time.perf_counter() - start < 0.005 or not scope.cancelled_caught
    assert dict(cuda.live_objects()) == live
    loaded = await cuda.load_artifact(artifact)
    cuda.destroy(loaded)


async def test_a_pipeline_that_loads_its_own_kernels_is_cancelled_at_once(
    cuda: accy.Backend,
) -> None:
    """Without a pool the call loads its kernels behind a 50 ms kernel on its stream (the load
    waits for it in the driver). Cancelled 5 ms in, it gives control back at once: no device
    call on the way out, which the driver would hold behind the load (44 ms before). What it
    owned is released once the stream is done."""
    slow = await cuda.load_artifact(await cuda.create_artifact(spec(cuda, "slow_fill_f32")))
    stamp = cuda.allocate_buffer(64)
    stream = cuda.create_stream()
    document = library.load_builtin("prefix_sum_i32")
    x, y = cuda.allocate_buffer(4096), cuda.allocate_buffer(4096)
    request = PipelineLaunch(
        pipeline=document.pipeline,
        registry=document.registry,
        format=accy.choose_format(cuda, document),
        operands=[x.bind("read_only")],
        results=[y.bind()],
        runtime_scalar_arguments=(p.U32(1024),),
        stream=stream,
    )
    live = dict(cuda.live_objects())
    late = []
    for _ in range(5):
        cuda.launch(
            slow,
            [stamp.bind()],
            [p.U32(1), p.F32(1), p.U64(50_000_000)],
            accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
            stream=stream,
        )
        with anyio.move_on_after(0.005) as scope:
            await launch_pipeline(cuda, request)
        late.append(time.perf_counter() - scope.deadline)
        assert scope.cancelled_caught
        await accy.wait_stream(cuda, stream)
        with anyio.fail_after(5):
            while dict(cuda.live_objects()) != live:  # deferred releases, the stream done
                cuda.collect_deferred()
                await anyio.sleep(0.001)
        # The releases' frees run on the backend's janitor thread; one still running when
        # the next slow kernel starts would hold this thread's next allocation behind it.
        await anyio.sleep(0.05)
    assert sorted(late)[2] < 0.015, late  # the kernel had 45 ms left
    cuda.destroy_all([slow, stamp, stream, x, y])


async def test_the_forecast_learns_a_length_set_by_a_scalar(cuda: accy.Backend) -> None:
    """slow_fill spins for its scalar's nanoseconds: after a few waits of random lengths the
    forecast of a new length is right, and the wait resumes close to it."""
    slow = await cuda.load_artifact(await cuda.create_artifact(spec(cuda, "slow_fill_f32")))
    buffer = cuda.allocate_buffer(64)
    stream, event = cuda.create_stream(), cuda.create_event()
    rng = random.Random(5)
    misses = []
    for index in range(40):
        nanoseconds = int(10 ** rng.uniform(4.7, 6.5))  # 50 us .. 3 ms
        cuda.launch(
            slow,
            [buffer.bind()],
            [p.U32(1), p.F32(1), p.U64(nanoseconds)],
            accy.LaunchConfig((1, 1, 1), (1, 1, 1)),
            stream=stream,
        )
        cuda.record_event(event, stream)
        expected = cuda.anticipate(event)
        await accy.wait_event(cuda, event)
        resumed = time.perf_counter()
        if index >= 20:
            assert expected is not None
            misses.append(abs(resumed - expected.due) / (nanoseconds * 1e-9 + 100e-6))
    misses.sort()
    assert misses[len(misses) // 2] < 0.2, misses
    cuda.destroy_all([slow, buffer, stream, event])


async def test_the_forecast_learns_a_pipeline_whose_length_follows_its_size(
    cuda: accy.Backend,
) -> None:
    """A prefix sum of random sizes, launched and read back as one burst: predicted once seen."""
    document = library.load_builtin("prefix_sum_i32")
    fmt = accy.ArtifactFormat.CUDA_SOURCE
    top = 200_000_000
    x, y = cuda.allocate_buffer(4 * top), cuda.allocate_buffer(4 * top)
    cuda.fill_buffer(x, 1)
    stream = cuda.create_stream()
    rng = random.Random(6)
    misses = []
    async with (
        await accy.load_pipeline_artifacts(cuda, document.pipeline, document.registry, fmt) as pool,
        await accy.allocate_pipeline_intermediates(
            cuda, document.pipeline, (p.U32(top),)
        ) as scratch,
    ):
        for index in range(40):
            n = int(10 ** rng.uniform(7, 8.3))  # 1e7..2e8: the device, not the host, sets it
            start = time.perf_counter()
            await launch_pipeline(
                cuda,
                PipelineLaunch(
                    pipeline=document.pipeline,
                    registry=document.registry,
                    format=fmt,
                    operands=[x.bind("read_only", byte_size=4 * n)],
                    results=[y.bind(byte_size=4 * n)],
                    runtime_scalar_arguments=(p.U32(n),),
                    intermediates=scratch,
                    artifacts=pool,
                    stream=stream,
                ),
            )
            read = cuda.enqueue_read(y, offset=4 * (n - 1), byte_size=4, stream=stream)
            mark = read.stream_mark()
            assert mark is not None
            expected = mark.anticipate()
            last = np.frombuffer(await accy.wait_read(read), np.int32)[0]
            resumed = time.perf_counter()
            assert last == n
            if index >= 20:
                assert expected is not None
                misses.append(abs(resumed - expected.due) / (resumed - start + 100e-6))
    misses.sort()
    assert misses[len(misses) // 2] < 0.2, misses  # of the request's time, launch to read
    cuda.destroy_all([x, y, stream])


async def test_reads_are_anticipated_and_a_cancelled_one_keeps_its_staging_until_it_lands(
    cuda: accy.Backend,
) -> None:
    slow = await cuda.load_artifact(await cuda.create_artifact(spec(cuda, "slow_fill_f32")))
    n = 1024
    source, target = cuda.allocate_buffer(4 * n), cuda.allocate_buffer(4 * n)
    stream = cuda.create_stream()

    def fill(value: float, nanoseconds: int) -> None:
        grid, block = grid_for(n)
        cuda.launch(
            slow,
            [source.bind()],
            [p.U32(n), p.F32(value), p.U64(nanoseconds)],
            accy.LaunchConfig(grid, block),
            stream=stream,
        )

    for repeat in range(10):  # the stream's duration is learned; the reads come back right
        fill(float(repeat), 1_000_000)
        got = await accy.download(cuda, source, np.float32, n, stream=stream)
        np.testing.assert_array_equal(got, np.full(n, repeat, np.float32))

    fill(7.0, 100_000_000)  # 100 ms, then a read of sevens nobody waits for
    read = cuda.enqueue_read(source, byte_size=4 * n, stream=stream)
    with anyio.move_on_after(0.01) as scope:
        await accy.wait_read(read)
    assert scope.cancelled_caught
    # An upload of the same size behind it on the stream: had the cancelled read's staging
    # block gone back at once, the upload would copy the sevens landing there instead.
    values = np.arange(n, dtype=np.float32)
    cuda.write_buffer(target, values.view(np.uint8).data, stream=stream)
    got = await accy.download(cuda, target, np.float32, n, stream=stream)
    np.testing.assert_array_equal(got, values)
    cuda.destroy_all([slow, source, target, stream])


async def test_writes_keep_their_staging_until_their_copies_land_and_wake_no_thread(
    cuda: accy.Backend,
) -> None:
    """Writes queued behind a 50 ms kernel: each keeps its pinned block until its copy has
    landed (the next writes take other blocks), and none asks the reactor to watch it."""
    slow = await cuda.load_artifact(await cuda.create_artifact(spec(cuda, "slow_fill_f32")))
    n = 1024
    stream = cuda.create_stream()
    scratch = cuda.allocate_buffer(4 * n)
    targets = [cuda.allocate_buffer(4 * n) for _ in range(40)]  # past the sweep threshold
    grid, block = grid_for(n)
    cuda.launch(
        slow,
        [scratch.bind()],
        [p.U32(n), p.F32(0.0), p.U64(50_000_000)],
        accy.LaunchConfig(grid, block),
        stream=stream,
    )
    values = np.empty(n, np.float32)
    for index, target in enumerate(targets):
        values[:] = index  # the caller reuses its array at once
        cuda.write_buffer(target, values.view(np.uint8).data, stream=stream)
    assert cuda.watched_completions == 0  # type: ignore[attr-defined]
    # Another stream's blocks come back while these 40 still wait behind the kernel.
    state = cuda._device_state  # type: ignore[attr-defined]
    other, spare = cuda.create_stream(), cuda.allocate_buffer(4 * n)
    cuda.write_buffer(spare, values.view(np.uint8).data, stream=other)
    await accy.wait_stream(cuda, other)
    cuda.write_buffer(spare, values.view(np.uint8).data, stream=other)
    assert len(state.staged[other.id]) == 1 and len(state.staged[stream.id]) == 40
    for index, target in enumerate(targets):
        got = await accy.download(cuda, target, np.float32, n, stream=stream)
        np.testing.assert_array_equal(got, np.full(n, index, np.float32))
    cuda.destroy_all([slow, scratch, spare, *targets, stream, other])


FAULT_SCRIPT = textwrap.dedent("""
    import anyio, sys, time
    sys.path.insert(0, {root!r})
    import accy_async as accy
    from tests.kernels import spec

    async def main():
        async with accy.open_backend("cuda") as backend:
            bad = await backend.load_artifact(await backend.create_artifact(
                spec(backend, "out_of_bounds")))
            slow = await backend.load_artifact(await backend.create_artifact(
                spec(backend, "slow_fill_f32")))
            buffer = backend.allocate_buffer(64)
            other = backend.create_stream()
            one = accy.LaunchConfig((1, 1, 1), (1, 1, 1))
            backend.launch(slow, [buffer.bind()], [accy.U32(1), accy.F32(1),
                           accy.U64(200_000_000)], one, stream=other)
            events = [backend.create_event() for _ in range(50)]
            for event in events:
                backend.record_event(event, other)
            read = backend.enqueue_read(buffer, stream=other)
            backend.launch(bad, [buffer.bind()], [], accy.LaunchConfig((1, 1, 1), (1, 1, 1)))
            failures = 0
            async def waiter(wait):
                nonlocal failures
                try:
                    await wait
                except accy.DeviceFault:
                    failures += 1
            start = time.perf_counter()
            with anyio.fail_after(20):
                async with anyio.create_task_group() as group:
                    group.start_soon(waiter, accy.wait_stream(backend))
                    group.start_soon(waiter, accy.wait_stream(backend, other))
                    group.start_soon(waiter, accy.wait_read(read))
                    for event in events:
                        group.start_soon(waiter, accy.wait_event(backend, event))
            refused = 0
            attempts = [
                lambda: backend.allocate_buffer(16),
                backend.create_stream,
                backend.create_event,
                lambda: backend.launch(slow, [buffer.bind()], [accy.U32(1), accy.F32(1),
                                       accy.U64(0)], accy.LaunchConfig((1, 1, 1), (1, 1, 1))),
                lambda: backend.record_event(events[0]),
            ]
            for attempt in attempts:
                try:
                    attempt()
                except accy.DeviceFault:
                    refused += 1
            print("FAILURES", failures, "REFUSED", refused,
                  "SECONDS", round(time.perf_counter() - start, 3))
    anyio.run(main)
""")


def test_an_out_of_bounds_kernel_is_a_device_fault_without_a_hang() -> None:
    if os.environ.get("ACCY_UNDER_SANITIZER"):
        pytest.skip("the planted fault would be reported by the sanitizer")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    completed = subprocess.run(
        [sys.executable, "-c", FAULT_SCRIPT.format(root=root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [os.path.join(root, "src"), root, os.environ.get("PYTHONPATH", "")]
            ),
        },
    )
    # Every waiter (two streams, a read, 50 events) fails; every new call is refused at once.
    assert "FAILURES 53 REFUSED 5" in completed.stdout, completed.stdout + completed.stderr
