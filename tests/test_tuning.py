"""Tuning on the CPU backend: winners, failures, budgets, timeouts, shared runs, cancellation,
the cache (also across processes), pipelines, and feeding results back."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.cli import main
from accy_async.errors import PlanError, UnsupportedOperation
from accy_async.kernels import LaunchOptions, SlotBinding, load_kernels
from accy_async.tuning import (
    Tuner,
    TuningCache,
    TuningProblem,
    TuningResult,
    TuningSettings,
    candidates_from_plan,
    choose_winner,
    sample_statistics,
)
from accy_async.tuning.results import CandidateResult

from . import kernels
from .conftest import GPU_AVAILABLE, needs_gpu
from .plans import artifact_plan, candidates
from .tuning_fixtures import QUICK, fixed, probe_problem


def assert_nothing_alive(backend: accy.Backend) -> None:
    assert dict(backend.live_objects()) == {}


async def test_the_fastest_candidate_wins_and_nothing_is_left(
    cpu_backend: accy.CpuBackend,
) -> None:
    problem = probe_problem()
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        result = await tuner.tune(problem)
    assert result.winner == 1  # block 128, no -DSLOW
    assert result.complete and not result.cached
    assert [c.status for c in result.candidates] == ["ok"] * 6
    slow = result.candidates[4]  # block 128 with -DSLOW: 2 steps slower
    assert slow.median_seconds > result.candidates[1].median_seconds + 0.0005
    assert all(5 <= c.samples <= 10 for c in result.candidates)
    assert result.device == cpu_backend.identity
    assert_nothing_alive(cpu_backend)


async def test_failed_candidates_are_recorded_not_raised(cpu_backend: accy.CpuBackend) -> None:
    bad_option = p.TuningCandidate(launch=fixed(128), compile_options=("-O3",))
    empty_grid = p.TuningCandidate(
        launch=p.DerivedLaunch(
            grid=(p.CeilDiv(argument_index=0, divisor=4096), p.Fixed(0), p.Fixed(1)),
            block=(128, 1, 1),
        )
    )
    problem = msgspec.structs.replace(
        probe_problem(), candidates=(*probe_problem().candidates[:2], bad_option, empty_grid)
    )
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        result = await tuner.tune(problem)
    statuses = [c.status for c in result.candidates]
    assert statuses == ["ok", "ok", "failed", "failed"]
    assert "-O3" in result.candidates[2].error and "InvalidArtifact" in result.candidates[2].error
    assert "LaunchArgumentMismatch" in result.candidates[3].error
    assert result.winner == 1
    assert_nothing_alive(cpu_backend)


async def test_a_candidate_past_its_timeout_fails_and_the_rest_go_on(
    cpu_backend: accy.CpuBackend,
) -> None:
    settings = TuningSettings(
        warmup=0, min_samples=3, max_samples=3, batch=3, candidate_timeout=0.3
    )
    problem = probe_problem(blocks=(128, 256), options=(("-DHANG=1",), ()))
    kernels.GATE.clear()
    try:
        async with Tuner(cpu_backend, settings=settings, compile_workers=1) as tuner:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as group:
                    result_box: list[TuningResult] = []

                    async def run() -> None:
                        result_box.append(await tuner.tune(problem))

                    group.start_soon(run)
                    await anyio.sleep(0.8)  # both hanging candidates time out first
                    kernels.GATE.set()
    finally:
        kernels.GATE.set()
    result = result_box[0]
    hung = [c for c in result.candidates if "timed out" in c.error]
    assert hung and all(c.status == "failed" for c in hung)
    # Once the gate opens, HANG candidates run normally: the winner is one that ran (which
    # one is a matter of timing, and a loaded machine can make block 256 measure faster).
    assert result.winner is not None
    winner = result.candidates[result.winner]
    assert winner.status == "ok" and winner not in hung
    assert_nothing_alive(cpu_backend)


async def test_a_budget_skips_what_it_cannot_reach_and_is_not_cached(
    cpu_backend: accy.CpuBackend, tmp_path: Path
) -> None:
    cache = TuningCache(tmp_path / "cache.msgpack")
    problem = probe_problem(blocks=(64, 128, 256, 512, 1024))
    async with Tuner(cpu_backend, settings=QUICK, cache=cache, concurrent=False) as tuner:
        result = await tuner.tune(problem, budget=0.05)
    assert not result.complete
    assert "skipped" in {c.status for c in result.candidates}
    assert cache.entries() == {}
    assert_nothing_alive(cpu_backend)


async def test_concurrent_tasks_each_get_their_problem(cpu_backend: accy.CpuBackend) -> None:
    problems = [probe_problem(f"probe{i}", n=16 + i) for i in range(3)]
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        results = await tuner.tune_all(problems)
    assert [r.problem for r in results] == ["probe0", "probe1", "probe2"]
    assert len({r.key for r in results}) == 3
    assert all(r.winner == 1 for r in results)
    assert_nothing_alive(cpu_backend)


async def test_equal_keys_share_one_run(cpu_backend: accy.CpuBackend) -> None:
    first, second = probe_problem("first"), probe_problem("second")
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        assert tuner.key(first) == tuner.key(second)
        kernels.TUNE_PROBE_CALLS[0] = 0
        alone = await tuner.tune(first)
        one_run = kernels.TUNE_PROBE_CALLS[0]
        kernels.TUNE_PROBE_CALLS[0] = 0
        results = await tuner.tune_all([first, second, first])
        shared = kernels.TUNE_PROBE_CALLS[0]
    sample_count = sum(c.samples for c in alone.candidates)
    assert one_run == sample_count + QUICK.warmup * 6
    assert shared <= max(c.samples for c in results[0].candidates) * 6 + QUICK.warmup * 6
    assert [r.problem for r in results] == ["first", "second", "first"]
    assert results[0].candidates == results[1].candidates == results[2].candidates
    assert_nothing_alive(cpu_backend)


async def test_cancelling_one_waiter_keeps_the_shared_run_for_the_other(
    cpu_backend: accy.CpuBackend,
) -> None:
    problem = probe_problem()
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        got: list[TuningResult] = []
        doomed = anyio.CancelScope()

        async def cancelled_waiter() -> None:
            with doomed:
                await tuner.tune(problem)

        async def patient_waiter() -> None:
            got.append(await tuner.tune(problem))

        async with anyio.create_task_group() as group:
            group.start_soon(cancelled_waiter)
            group.start_soon(patient_waiter)
            await anyio.sleep(0.02)
            doomed.cancel()
    assert got and got[0].winner == 1 and got[0].complete
    assert_nothing_alive(cpu_backend)


@pytest.mark.parametrize("delay", [0.0, 0.003, 0.015, 0.04])
async def test_cancelling_a_tune_leaves_nothing_behind(
    cpu_backend: accy.CpuBackend, delay: float
) -> None:
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        with anyio.move_on_after(delay) as scope:
            await tuner.tune(probe_problem(blocks=(64, 128, 256, 512, 1024)))
        assert scope.cancelled_caught
    await accy.synchronize(cpu_backend)
    cpu_backend.collect_deferred()
    assert_nothing_alive(cpu_backend)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_task_cancel_is_not_swallowed(cpu_backend: accy.CpuBackend) -> None:
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        task = asyncio.ensure_future(tuner.tune(probe_problem()))
        await asyncio.sleep(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await accy.synchronize(cpu_backend)
    cpu_backend.collect_deferred()
    assert_nothing_alive(cpu_backend)


async def test_the_cache_answers_the_second_time(
    cpu_backend: accy.CpuBackend, tmp_path: Path
) -> None:
    path = tmp_path / "tuning.msgpack"
    async with Tuner(cpu_backend, settings=QUICK, cache=path) as tuner:
        fresh = await tuner.tune(probe_problem())
    kernels.TUNE_PROBE_CALLS[0] = 0
    async with Tuner(cpu_backend, settings=QUICK, cache=path) as tuner:
        again = await tuner.tune(probe_problem("renamed"))
    assert kernels.TUNE_PROBE_CALLS[0] == 0
    assert again.cached and again.problem == "renamed"
    assert again.candidates == fresh.candidates and again.winner == fresh.winner
    other_size = probe_problem(n=32)
    async with Tuner(cpu_backend, settings=QUICK, cache=path) as tuner:
        assert not (await tuner.tune(other_size)).cached  # scalars are part of the key
    assert len(TuningCache(path).entries()) == 2


def test_the_key_covers_device_source_options_and_scalars() -> None:
    from accy_async.tuning import tuning_key

    identity = accy.backends.DeviceIdentity(
        kind="cuda", name="H200", uuid="GPU-1", driver="cuda 13.0", compiler="nvrtc 13.0"
    )
    base = probe_problem()
    key = tuning_key(identity, base, flush_cache=False)
    variants = [
        tuning_key(msgspec.structs.replace(identity, uuid="GPU-2"), base, flush_cache=False),
        tuning_key(msgspec.structs.replace(identity, driver="cuda 12.8"), base, flush_cache=False),
        tuning_key(identity, probe_problem(n=17), flush_cache=False),
        tuning_key(identity, probe_problem(options=((), ("-DSLOW=2",))), flush_cache=False),
        tuning_key(identity, base, flush_cache=True),
    ]
    assert key not in variants and len(set(variants)) == len(variants)
    assert tuning_key(identity, probe_problem("other"), flush_cache=False) == key


def test_two_processes_writing_the_cache_at_once_keep_every_entry(tmp_path: Path) -> None:
    path = tmp_path / "shared.msgpack"
    script = textwrap.dedent(
        """
        import sys
        from accy_async.backends import DeviceIdentity
        from accy_async.tuning import TuningCache, TuningResult
        cache = TuningCache(sys.argv[1])
        who = sys.argv[2]
        identity = DeviceIdentity(kind="cpu", name="x", uuid="", driver="", compiler="")
        for i in range(40):
            cache.put(f"{who}-{i}", TuningResult(problem=who, key=f"{who}-{i}", device=identity,
                      candidates=(), winner=None, complete=True, wall_seconds=float(i)))
        """
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", script, str(path), who]) for who in ("a", "b")
    ]
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    entries = TuningCache(path).entries()
    assert sorted(entries) == sorted(f"{w}-{i}" for w in "ab" for i in range(40))
    assert entries["b-39"].wall_seconds == 39.0


def test_a_corrupt_cache_is_set_aside_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "tuning.msgpack"
    path.write_bytes(b"\xc1 not msgpack")
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        assert TuningCache(path).entries() == {}
    assert (tmp_path / "tuning.msgpack.corrupt").exists()


def test_two_processes_setting_a_corrupt_cache_aside_at_once_do_not_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other process moved the corrupt file between this one's read and its move."""
    path = tmp_path / "tuning.msgpack"
    path.write_bytes(b"\xc1 not msgpack")
    replace = os.replace

    def the_other_process_first(source: Path, target: Path) -> None:
        replace(source, target)  # the other process's move
        replace(source, target)  # this one's: the file is gone

    monkeypatch.setattr(os, "replace", the_other_process_first)
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        assert TuningCache(path).entries() == {}
    assert (tmp_path / "tuning.msgpack.corrupt").exists()


async def test_a_pipeline_is_tuned_end_to_end(cpu_backend: accy.CpuBackend) -> None:
    problem = p.PipelineTuningProblem(
        name="scan",
        candidates=tuple(library.prefix_sum(p.DType.F32, block) for block in (64, 256)),
        runtime_scalar_arguments=(p.scalar("u32", 50_000),),
    )
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        result = await tuner.tune(problem)
    assert all(c.status == "ok" for c in result.candidates)
    assert result.tuned_document(problem) in problem.candidates
    assert_nothing_alive(cpu_backend)


async def test_results_feed_registry_entries_and_loaded_kernels(
    cpu_backend: accy.CpuBackend,
) -> None:
    problem = probe_problem()
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        result = await tuner.tune(problem)
    entry = p.RegistryEntry(
        target="probe",
        version=1,
        format=p.ArtifactFormat.CPU,
        entry_name="tune_probe",
        argument_count=2,
        runtime_scalar_argument_count=1,
        payload=p.CpuKernelPayload("tests.tune_probe"),
        launch=fixed(1024),
    )
    tuned = result.tuned_entry(entry, problem)
    assert tuned.launch == fixed(128) and tuned.compile_options == ()
    assert result.tuned_artifact(problem) == problem.artifact

    plan = artifact_plan(
        {0: 64},
        p.PlannedKernel(
            kernel_id=7,
            work_item_id=0,
            output_slot_id=0,
            artifact=problem.artifact,
            launch_resources=candidates(512, 128),
            runtime_scalar_argument_count=1,
            runtime_scalar_defaults=(p.scalar("u32", 16),),
        ),
    )
    from_plan = msgspec.structs.replace(problem, candidates=candidates_from_plan(plan.kernels[0]))
    async with Tuner(cpu_backend, settings=QUICK) as tuner:
        planned_result = await tuner.tune(from_plan)
    assert planned_result.winner == 1
    buffer = cpu_backend.allocate_buffer(64)
    async with await load_kernels(cpu_backend, plan) as loaded:
        loaded.launch_kernel(
            0,
            [SlotBinding(0, buffer.bind())],
            options=LaunchOptions(tuning=planned_result.launch_tuning(7)),
        )
        got = await accy.download(cpu_backend, buffer, np.uint32, 1)
    assert int(got[0]) == 128
    cpu_backend.destroy(buffer)


async def test_workspace_contents_repeat_a_random_block_and_restore(
    cpu_backend: accy.CpuBackend,
) -> None:
    from accy_async.tuning.subjects import RANDOM_BLOCK, buffer_plan, create_workspace

    n = 3 * RANDOM_BLOCK + 5
    problem = msgspec.structs.replace(
        probe_problem(),
        buffers=(p.TuningBuffer(byte_size=4 * n, initial="random", restore=True),),
    )
    stream = cpu_backend.create_stream()
    workspace = create_workspace(cpu_backend, stream, buffer_plan(problem))
    buffer = workspace.buffers[0]
    read = cpu_backend.enqueue_read(buffer, stream=stream)
    first = np.frombuffer(await accy.wait_read(read), np.float32)
    block = first[:RANDOM_BLOCK]
    assert len(np.unique(block)) > RANDOM_BLOCK // 2 and (block >= 0).all() and (block < 1).all()
    np.testing.assert_array_equal(first, np.resize(block, n))
    cpu_backend.fill_buffer(buffer, 0, stream=stream)  # an in-place kernel's damage
    workspace.before_sample()
    again = np.frombuffer(
        await accy.wait_read(cpu_backend.enqueue_read(buffer, stream=stream)), np.float32
    )
    np.testing.assert_array_equal(again, first)
    await workspace.aclose()
    cpu_backend.destroy(stream)
    assert_nothing_alive(cpu_backend)


def test_statistics_and_ties() -> None:
    stats = sample_statistics([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (stats.median, stats.low, stats.q1, stats.q3, stats.count) == (3.0, 1.0, 2.0, 4.0, 5)
    assert sample_statistics([1.0, 3.0]).median == 2.0
    with pytest.raises(ValueError, match="no samples"):
        sample_statistics([])

    def ok(index: int, median: float) -> CandidateResult:
        return CandidateResult(index=index, label="", status="ok", median_seconds=median)

    measured = [ok(0, 1.015), ok(1, 1.0), ok(2, 0.5 * 2.1)]
    assert choose_winner(measured, 0.02) == 0  # within 2% of the fastest: first declared wins
    assert choose_winner(measured, 0.001) == 1
    failed = CandidateResult(index=0, label="", status="failed")
    assert choose_winner([failed], 0.02) is None


def test_settings_and_documents_are_checked() -> None:
    with pytest.raises(accy.LaunchArgumentMismatch):
        TuningSettings(min_samples=10, max_samples=5)
    document = p.TuningDocument(kernels=(probe_problem(),))
    assert p.decode_json(p.encode_json(document), p.PlanDocument) == document
    assert p.decode_msgpack(p.encode_msgpack(document), p.TuningDocument) == document
    raw = json.loads(p.encode_json(document))
    raw["kernels"][0]["buffers"] = []
    with pytest.raises(PlanError) as error:
        p.decode_json(json.dumps(raw), p.PlanDocument)
    assert error.value.path == "$.kernels[0].buffers"
    raw["kernels"] = [raw["kernels"][0], raw["kernels"][0]]
    raw["kernels"][0]["buffers"] = raw["kernels"][0]["buffers"] or [{"byte_size": 64}]
    with pytest.raises(PlanError) as error:
        p.decode_json(json.dumps(raw), p.TuningDocument)
    assert "duplicate problem name" in str(error.value)


async def test_timing_events_measure_on_the_worker(cpu_backend: accy.CpuBackend) -> None:
    start, end = cpu_backend.create_event(timing=True), cpu_backend.create_event(timing=True)
    plain = cpu_backend.create_event()
    loaded = await kernels.load(cpu_backend, "slow_fill_f32")
    out = cpu_backend.allocate_buffer(16)
    cpu_backend.record_event(start)
    cpu_backend.launch(
        loaded,
        [out.bind()],
        [p.scalar("u32", 4), p.scalar("f32", 1.0), p.scalar("u64", 20_000_000)],
        accy.LaunchConfig((1, 1, 1), (4, 1, 1)),
    )
    cpu_backend.record_event(end)
    cpu_backend.record_event(plain)
    with pytest.raises(UnsupportedOperation, match="not completed"):
        cpu_backend.elapsed_seconds(start, end)
    await accy.wait_event(cpu_backend, end)
    assert 0.019 < cpu_backend.elapsed_seconds(start, end) < 0.5
    with pytest.raises(UnsupportedOperation, match="without timing"):
        cpu_backend.elapsed_seconds(start, plain)
    cpu_backend.destroy_all([start, end, plain, loaded, out])


def test_cli_tune_prints_a_table_and_caches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_file = tmp_path / "probe.json"
    plan_file.write_bytes(p.encode_json(p.TuningDocument(kernels=(probe_problem(),))))
    cache = tmp_path / "cache.msgpack"
    arguments = ["tune", str(plan_file), "--backend", "cpu", "--cache", str(cache)]
    assert main(arguments) == 0
    captured = capsys.readouterr()
    assert "probe" in captured.out and "block 128" in captured.out
    assert "[" in captured.err and "6/6" in captured.err  # the progress bar
    assert "tuning 1 problems (6 candidates)" in captured.err  # said before it starts
    assert "s left" in captured.err  # the estimate, by the pace so far
    assert "6/6 ~0 s left" in captured.err
    assert main([*arguments, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["results"][0]["cached"] is True
    assert report["results"][0]["winner"] == 1


def test_cli_tune_takes_a_builtin_plan_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "saxpy_f32", "--backend", "cpu", "-n", "20000", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "saxpy.f32" in out and "prefix_sum.f32" not in out


def test_cli_tunes_the_builtin_kernels_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--backend", "cpu", "-n", "20000", "--no-cache", "--quiet"]) == 0
    out = capsys.readouterr().out
    for name in (
        "saxpy.f32",
        "partial_sum.f32",
        "block_scan.f32",
        "prefix_sum.f32",
        "prefix_sum_single_pass.f32",
    ):
        assert name in out


# ----- on the GPU --------------------------------------------------------------------------


@pytest.fixture
async def cuda_backend() -> AsyncIterator[accy.Backend]:
    if not GPU_AVAILABLE:
        pytest.skip("no NVIDIA GPU and driver here")
    async with accy.open_backend("cuda") as opened:
        yield opened


@pytest.mark.gpu
async def test_cuda_tunes_the_builtin_kernels_with_device_timing(
    cuda_backend: accy.Backend,
) -> None:
    document = library.tuning_document(p.ArtifactFormat.CUDA_SOURCE, 1 << 20)
    settings = TuningSettings(min_samples=10, max_samples=50, flush_cache=True)
    problems: list[TuningProblem] = [*document.kernels, *document.pipelines]
    async with Tuner(cuda_backend, settings=settings) as tuner:
        results = await tuner.tune_all(problems)
    for problem, result in zip(problems, results, strict=True):
        assert [c.status for c in result.candidates] == ["ok"] * len(problem.candidates), result
        best = result.best
        assert best is not None
        # 1M floats: microseconds, not the milliseconds a host-timed sample would show
        # (under compute-sanitizer the instrumented kernels take milliseconds themselves).
        ceiling = 20e-3 if os.environ.get("ACCY_UNDER_SANITIZER") else 2e-3
        assert 1e-7 < best.median_seconds < ceiling
    identity = cuda_backend.identity
    assert identity.kind == "cuda" and identity.uuid.startswith("GPU-")
    assert identity.compiler.startswith("nvrtc")
    assert dict(cuda_backend.live_objects()) == {}


@pytest.mark.gpu
async def test_cuda_candidates_that_fail_to_compile_or_launch_are_recorded(
    cuda_backend: accy.Backend,
) -> None:
    if os.environ.get("ACCY_UNDER_SANITIZER"):
        pytest.skip("the planted invalid launch would be reported by the sanitizer")
    document = library.tuning_document(p.ArtifactFormat.CUDA_SOURCE, 1 << 16)
    saxpy = document.kernels[0]
    good = saxpy.candidates[0]
    too_much_shared = p.TuningCandidate(
        launch=p.FixedLaunch(
            geometry=p.LaunchGeometry(
                grid=(512, 1, 1), block=(128, 1, 1), shared_memory_bytes=200_000
            )
        ),
        label="needs more dynamic shared memory than a block may have without opting in",
    )
    does_not_compile = p.TuningCandidate(
        launch=good.launch, compile_options=("-DACCY_ITEMS=no_such_name",), label="bad define"
    )
    problem = msgspec.structs.replace(saxpy, candidates=(good, too_much_shared, does_not_compile))
    async with Tuner(cuda_backend, settings=TuningSettings(max_samples=20)) as tuner:
        result = await tuner.tune(problem)
    assert [c.status for c in result.candidates] == ["ok", "failed", "failed"]
    assert "CompilationError" in result.candidates[2].error
    assert "no_such_name" in result.candidates[2].error
    assert result.winner == 0
    assert cuda_backend.fault is None
    assert dict(cuda_backend.live_objects()) == {}


@pytest.mark.gpu
async def test_cuda_timing_events_give_device_time(cuda_backend: accy.Backend) -> None:
    start, end = cuda_backend.create_event(timing=True), cuda_backend.create_event(timing=True)
    loaded = await kernels.load(cuda_backend, "slow_fill_f32")
    out = cuda_backend.allocate_buffer(16)
    cuda_backend.record_event(start)
    cuda_backend.launch(
        loaded,
        [out.bind()],
        [p.scalar("u32", 4), p.scalar("f32", 1.0), p.scalar("u64", 2_000_000)],
        accy.LaunchConfig((1, 1, 1), (4, 1, 1)),
    )
    cuda_backend.record_event(end)
    await accy.wait_event(cuda_backend, end)
    assert 0.0019 < cuda_backend.elapsed_seconds(start, end) < 0.01
    cuda_backend.destroy_all([start, end, loaded, out])


@pytest.mark.gpu
@needs_gpu
def test_cli_tune_on_the_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache.msgpack"
    arguments = ["tune", "--backend", "cuda", "-n", "1000000", "--cache", str(cache), "--quiet"]
    assert main(arguments) == 0
    first = capsys.readouterr().out
    assert "saxpy.f32" in first and "(cached)" not in first
    assert main(arguments) == 0
    assert first.count("\n") == capsys.readouterr().out.count("(cached)") + 2
