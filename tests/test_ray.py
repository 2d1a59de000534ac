"""Ray: a local cluster of CPU-backend actors behind the router (the ``ray`` extra).

1,000 mixed requests answered right; an actor killed mid-run: every request
answered once and right; a cancelled caller leaves no work running; the actors'
backends hold nothing at the end. The router runs on asyncio (Ray's awaitable
references), so these tests do too.
"""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

ray = pytest.importorskip("ray")

import accy_async as accy  # noqa: E402
from accy_async import plan as p  # noqa: E402
from accy_async.library import tuning_document  # noqa: E402
from accy_async.ray import PipelineActor, PipelineActorImpl, Resident, Router  # noqa: E402
from accy_async.testing import assert_checkpoint  # noqa: E402
from accy_async.tuning import TuningSettings  # noqa: E402

from .conftest import GPU_AVAILABLE, needs_gpu  # noqa: E402


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        num_cpus=4,
        num_gpus=1 if GPU_AVAILABLE else 0,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def _request(rng: random.Random) -> tuple[str, list[np.ndarray[Any, Any]], dict[str, Any], Any]:
    """A random request: the plan, its arrays and scalars, and the expected result."""
    n = rng.choice([1, 7, 1000, 4097, 30_000])
    kind = rng.choice(["prefix_sum_i32", "prefix_sum_f32", "saxpy_f32"])
    if kind == "prefix_sum_i32":
        x = np.arange(n, dtype=np.int32) % 7
        return kind, [x], {}, np.cumsum(x, dtype=np.int32)
    if kind == "prefix_sum_f32":
        x = np.ones(n, np.float32)
        return kind, [x], {}, np.arange(1, n + 1, dtype=np.float32)
    x, y = np.full(n, 2, np.float32), np.arange(n, dtype=np.float32)
    return kind, [x, y], {"a": 1.5}, np.float32(1.5) * x + y


def _actors(count: int, backend: str = "cpu") -> list[Any]:
    if backend == "cuda":  # the actors share the one GPU a test machine may have
        return [PipelineActor.options(num_gpus=1 / count).remote("cuda") for _ in range(count)]
    return [PipelineActor.options(num_cpus=0.5).remote(backend) for _ in range(count)]


async def _close(actors: list[Any]) -> list[int]:
    return [await actor.close.remote() for actor in actors]


async def test_a_thousand_mixed_requests_are_answered_right(cluster: None) -> None:
    actors = _actors(2)
    router = Router(actors, max_in_flight=8)
    rng = random.Random(1)
    wrong: list[int] = []

    async def one(index: int) -> None:
        plan, arrays, scalars, expected = _request(rng)
        (got,) = await router.call(plan, *arrays, **scalars)
        if not np.allclose(got, expected, rtol=1e-5):
            wrong.append(index)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            for index in range(1000):
                group.start_soon(one, index)
    assert wrong == []
    served = [await actor.warm_plans.remote() for actor in actors]
    assert all(served), "both actors served"
    assert await _close(actors) == [0, 0]


async def test_a_killed_actor_loses_no_request_and_answers_none_twice(cluster: None) -> None:
    actors = _actors(3)
    router = Router(actors, max_in_flight=4)
    rng = random.Random(2)
    answers: dict[int, int] = {}
    wrong: list[int] = []

    async def one(index: int) -> None:
        plan, arrays, scalars, expected = _request(rng)
        (got,) = await router.call(plan, *arrays, **scalars)
        answers[index] = answers.get(index, 0) + 1
        if not np.allclose(got, expected, rtol=1e-5):
            wrong.append(index)

    async def kill_one() -> None:
        await anyio.sleep(0.3)
        ray.kill(actors[0], no_restart=True)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            group.start_soon(kill_one)
            for index in range(300):
                group.start_soon(one, index)
    assert wrong == []
    assert sorted(answers) == list(range(300)) and set(answers.values()) == {1}
    assert router.alive == 2
    assert await _close(actors[1:]) == [0, 0]


@pytest.mark.gpu
@needs_gpu
async def test_cuda_actors_answer_right_and_lose_nothing_when_one_is_killed(cluster: None) -> None:
    """Two CUDA actors on the GPU: mixed requests right, one killed mid-run, each answered once."""
    actors = _actors(2, "cuda")
    router = Router(actors, max_in_flight=8)
    rng = random.Random(3)
    answers: dict[int, int] = {}
    wrong: list[int] = []
    half_answered = anyio.Event()  # the rest still queued or running

    async def one(index: int) -> None:
        plan, arrays, scalars, expected = _request(rng)
        (got,) = await router.call(plan, *arrays, **scalars)
        answers[index] = answers.get(index, 0) + 1
        if len(answers) >= 500:
            half_answered.set()
        if not np.allclose(got, expected, rtol=1e-5):
            wrong.append(index)

    async def kill_one() -> None:
        await half_answered.wait()
        ray.kill(actors[0], no_restart=True)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            for index in range(200):  # warm both actors (CUDA contexts, kernels) first
                group.start_soon(one, index)
        async with anyio.create_task_group() as group:
            group.start_soon(kill_one)
            for index in range(200, 1000):
                group.start_soon(one, index)
    assert wrong == []
    assert sorted(answers) == list(range(1000)) and set(answers.values()) == {1}
    assert router.alive == 1
    assert await _close(actors[1:]) == [0]
    ray.kill(actors[1])  # its share of the GPU back for the next test


async def test_a_cancelled_caller_leaves_no_work_running(cluster: None) -> None:
    (actor,) = _actors(1)
    router = Router([actor])
    big = np.ones(40_000_000, np.float32)
    with anyio.move_on_after(0.2) as scope:
        await router.call("prefix_sum_f32", big)
    assert scope.cancelled_caught
    with anyio.fail_after(30):
        while await actor.in_flight.remote():  # noqa: ASYNC110 - the actor's count, remote
            await anyio.sleep(0.05)
    (small,) = await router.call("prefix_sum_f32", np.ones(5, np.float32))
    assert small.tolist() == [1, 2, 3, 4, 5]
    assert await _close([actor]) == [0]


async def test_a_retried_request_id_is_answered_from_its_record() -> None:
    """The actor's own bookkeeping, without Ray: the same id runs once, and a checkpoint."""
    actor = PipelineActorImpl("cpu")
    x = np.arange(10, dtype=np.int32)
    first = await actor.call("id-1", "prefix_sum_i32", [x])
    again = await actor.call("id-1", "prefix_sum_i32", [np.zeros(10, np.int32)])
    assert actor.served == 1 and again[0].tolist() == first[0].tolist()
    await assert_checkpoint(lambda: actor.call("id-1", "prefix_sum_i32", [x]))
    for method in (actor.warm_plans, actor.in_flight, actor.served_count):
        await assert_checkpoint(method)
    assert await actor.close() == 0


async def test_kept_results_chain_on_the_actor_without_moving_data() -> None:
    """The actor's own bookkeeping, without Ray: kept results as operands, fetched, released;
    a plan document and a device graph beside built-in names."""
    actor = PipelineActorImpl("cpu")
    x = np.arange(1000, dtype=np.float32) % 7
    expected = np.cumsum(x, dtype=np.float64)
    (kept,) = await actor.call("r1", "prefix_sum_f32", [x], keep=True)
    assert isinstance(kept, Resident) and kept.size == 1000 and kept.holder == actor.identity
    (y,) = await actor.call("r2", "saxpy_f32", [kept, x], {"a": 2.0})
    np.testing.assert_allclose(y, 2 * expected + x, rtol=1e-5)
    (z,) = await actor.call("r3", "saxpy_f32", [kept, kept], {"a": 1.0}, keep=True)
    (back,) = await actor.fetch([z.key])
    np.testing.assert_allclose(back, 2 * expected, rtol=1e-5)
    assert await actor.kept() == 2
    stranger = Resident("another actor", "k", "<f4", 1000)
    with pytest.raises(accy.LaunchArgumentMismatch, match="not kept on this actor"):
        await actor.call("r4", "saxpy_f32", [stranger, x], {"a": 1.0})
    document = accy.library.load_builtin("prefix_sum_f32")
    (scanned,) = await actor.call("r5", document, [x], device_graph=True)
    np.testing.assert_allclose(scanned, expected, rtol=1e-5)
    assert document.pipeline.target in await actor.warm_plans()
    await assert_checkpoint(lambda: actor.release([]))
    assert await actor.release([kept.key, z.key, "never kept"]) == 2
    assert await actor.kept() == 0
    await actor.call("r6", "prefix_sum_f32", [x], keep=True)
    assert await actor.forget("r6") == 1  # a router's caller cancelled after sending it
    assert await actor.kept() == 0
    for method in (actor.kept, actor.holder):
        await assert_checkpoint(method)
    await assert_checkpoint(lambda: actor.forget("never sent"))
    await assert_checkpoint(lambda: actor.fetch([]))
    router = Router([object()])  # nothing to send: neither needs an actor
    await assert_checkpoint(router.fetch)
    await assert_checkpoint(router.release)
    assert await actor.close() == 0


async def test_kept_results_on_a_backend_that_runs_nothing_are_host_arrays() -> None:
    """The recording backend (no real memory): kept results are NumPy arrays, as on the CPU."""
    actor = PipelineActorImpl("recording")
    x = np.ones(64, np.float32)
    (kept,) = await actor.call("r1", "prefix_sum_f32", [x], keep=True)
    (y,) = await actor.call("r2", "saxpy_f32", [kept, x], {"a": 1.0})
    assert y.shape == (64,)
    (back,) = await actor.fetch([kept.key])
    assert back.shape == (64,) and back.dtype == np.float32
    assert await actor.release([kept.key]) == 1
    assert await actor.close() == 0


async def test_kept_results_run_on_their_actor_and_die_with_it(cluster: None) -> None:
    actors = _actors(2)
    router = Router(actors, max_in_flight=1)  # six at once: spread over both
    names = [await actor.holder.remote() for actor in actors]
    x = np.ones(5000, np.float32)
    kept: list[Resident] = []

    async def keep_one() -> None:
        kept.extend(await router.call("prefix_sum_f32", x, keep=True))

    async with anyio.create_task_group() as group:
        for _ in range(6):
            group.start_soon(keep_one)
    assert {each.holder for each in kept} == set(names)
    for each in kept:  # each chained call runs where its operand is kept
        (y,) = await router.call("saxpy_f32", each, x, a=2.0)
        np.testing.assert_allclose(y, 2 * np.arange(1, 5001) + 1, rtol=1e-5)
    for fetched in await router.fetch(*kept):
        np.testing.assert_allclose(fetched, np.arange(1, 5001), rtol=1e-5)
    first, other = kept[0], next(each for each in kept if each.holder != kept[0].holder)
    with pytest.raises(accy.LaunchArgumentMismatch, match="different actors"):
        await router.call("saxpy_f32", first, other, a=1.0)
    victim = actors[names.index(first.holder)]
    survivor = actors[1 - names.index(first.holder)]
    ray.kill(victim, no_restart=True)
    await _until_dead(victim)  # the kill is asynchronous: a call sent at once may still run
    with pytest.raises(accy.RuntimeUnavailable, match="has died"):
        await router.call("saxpy_f32", first, x, a=1.0)
    with pytest.raises(accy.RuntimeUnavailable, match="has died"):
        await router.fetch(first)
    (z,) = await router.call("saxpy_f32", other, other, a=1.0)  # the survivor's still work
    np.testing.assert_allclose(z, 2 * np.arange(1, 5001), rtol=1e-5)
    survivors = sum(each.holder == other.holder for each in kept)
    (again,) = await Router(actors).fetch(other)  # another router learns who keeps it
    np.testing.assert_allclose(again, np.arange(1, 5001), rtol=1e-5)
    assert await router.release(*kept) == survivors
    assert await survivor.kept.remote() == 0
    assert await _close([survivor]) == [0]


async def _until_dead(actor: Any) -> None:
    """Return once ``actor`` answers no more (within 60 s, a loaded machine included)."""
    with anyio.fail_after(60):
        while True:
            try:
                await actor.holder.remote()
            except ray.exceptions.RayActorError:
                return
            await anyio.sleep(0.05)


@pytest.mark.gpu
@needs_gpu
async def test_kept_results_stay_in_device_memory_on_a_cuda_actor(cluster: None) -> None:
    (actor,) = _actors(1, "cuda")
    router = Router([actor])
    x = (np.arange(100_000) % 5).astype(np.float32)
    expected = np.cumsum(x, dtype=np.float64)
    (kept,) = await router.call("prefix_sum_f32", x, keep=True)
    (twice,) = await router.call("saxpy_f32", kept, kept, a=1.0, keep=True)
    (y,) = await router.call("saxpy_f32", twice, x, a=0.5)
    np.testing.assert_allclose(y, expected + x, rtol=1e-4)
    (back,) = await router.fetch(twice)
    np.testing.assert_allclose(back, 2 * expected, rtol=1e-4)
    assert await router.release(kept, twice) == 2
    # A launch graph's slots kept on the device, chained into a pipeline and another graph.
    document = saxpy_graph(p.ArtifactFormat.CUDA_SOURCE, x.size)
    slot = (await router.call_graph(document, {1: x, 2: x}, keep=True))[4]  # 2.5 x
    (scanned,) = await router.call("prefix_sum_f32", slot)
    np.testing.assert_allclose(scanned, np.cumsum(2.5 * x, dtype=np.float64), rtol=1e-4)
    out = await router.call_graph(document, {1: slot, 2: x}, read=[3], device_graph=True)
    np.testing.assert_allclose(out[3], 6 * x, rtol=1e-6)
    assert await router.release(slot) == 1
    # A pipeline problem tuned on the GPU, then served by its name.
    result = await router.tune(scan_problem(p.ArtifactFormat.CUDA_SOURCE, 1 << 20), settings=QUICK)
    assert result.complete and result.winner is not None
    (tuned,) = await router.call("prefix_sum.f32", x)
    np.testing.assert_allclose(tuned, expected, rtol=1e-4)
    assert await _close([actor]) == [0]
    ray.kill(actor)


@pytest.mark.gpu
@needs_gpu
async def test_a_released_result_is_freed_on_a_cuda_actor_without_later_calls() -> None:
    """The calls that read or wrote a kept result hold it until told (a later call, or the
    release): released, its device memory goes once the device is done with it."""
    actor = PipelineActorImpl("cuda")
    x = np.ones(1 << 20, np.float32)
    (kept,) = await actor.call("r1", "prefix_sum_f32", [x], keep=True)
    view = weakref.ref(actor._kept[kept.key])
    (y,) = await actor.call("r2", "saxpy_f32", [kept, x], {"a": 2.0})
    np.testing.assert_allclose(y[:3], [3.0, 5.0, 7.0])
    assert await actor.release([kept.key]) == 1
    gc.collect()
    assert view() is None  # no lane holds it any more
    assert await actor.close() == 0


async def test_a_caller_cancelled_while_its_result_is_kept_leaves_nothing_kept(
    cluster: None,
) -> None:
    (actor,) = _actors(1)
    router = Router([actor])
    x = np.ones(2_000_000, np.float32)
    await router.call("prefix_sum_f32", x[:10])  # warm: the cancellations land in the run
    for seconds in (0.001, 0.005, 0.01, 0.02, 0.05, 0.1):
        with anyio.move_on_after(seconds) as scope:
            kept = await router.call("prefix_sum_f32", x, keep=True)
        if not scope.cancelled_caught:  # answered in time: the caller holds the handle
            assert await router.release(*kept) == 1
        with anyio.move_on_after(10):  # the cancellation, and any forget, reach the actor
            while await actor.in_flight.remote() or await actor.kept.remote():  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert await actor.kept.remote() == 0, seconds
    assert await _close([actor]) == [0]


def saxpy_graph(fmt: p.ArtifactFormat, n: int) -> p.LaunchGraphDocument:
    """Two built-in saxpy kernels as a launch graph: slot 3 = 2 * x + y, slot 4 = 0.5 * slot 3
    + x, for ``x`` in slot 1 and ``y`` in slot 2 (kernels any actor has, unlike the tests')."""
    entry = next(
        each
        for each in accy.library.load_builtin("saxpy_f32").registry.entries
        if each.format is fmt
    )

    def kernel(kernel_id: int, output: int, inputs: tuple[int, ...], a: float) -> p.PlannedKernel:
        return p.PlannedKernel.from_entry(entry, kernel_id, output, inputs, (p.U32(n), p.F32(a)))

    slots = tuple(p.Slot(slot_id=i, byte_size=4 * n, dtype=p.DType.F32) for i in (1, 2, 3, 4))
    plan = p.ArtifactPlan(
        slots=slots, kernels=(kernel(0, 3, (1, 2), 2.0), kernel(1, 4, (3, 1), 0.5))
    )
    return p.LaunchGraphDocument(artifact_plan=plan)


def scan_problem(fmt: p.ArtifactFormat, n: int) -> p.PipelineTuningProblem:
    """The built-in tuning problem of the three-stage prefix sum over its block sizes."""
    document = tuning_document(fmt, n=n)
    return next(each for each in document.pipelines if each.name == "prefix_sum.f32")


QUICK = TuningSettings(warmup=1, min_samples=3, max_samples=10, batch=3, precision=0.2)


async def test_graph_calls_and_tuned_plans_on_the_actor_itself() -> None:
    """The actor's own bookkeeping, without Ray: a launch graph served with arrays for its
    slots (answered once per id, kept, chained into a pipeline call), a pipeline problem
    tuned and served by its name, a tuned plan handed to another actor."""
    actor, other = PipelineActorImpl("cpu"), PipelineActorImpl("cpu")
    n = 3000
    document = saxpy_graph(p.ArtifactFormat.CPU, n)
    x, y = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
    expected = 0.5 * (2 * x + y) + x
    out = await actor.call_graph("g1", document, {1: x, 2: y}, [3, 4])
    np.testing.assert_array_equal(out[3], 2 * x + y)
    np.testing.assert_array_equal(out[4], expected)
    again = await actor.call_graph("g1", document, {1: y, 2: y}, [4])  # the id's record
    assert actor.served == 1 and again[4].tolist() == out[4].tolist()
    await assert_checkpoint(lambda: actor.call_graph("g1", document, {1: y, 2: y}, [4]))
    kept = (await actor.call_graph("g2", document, {1: x, 2: y}, keep=True))[4]
    assert isinstance(kept, Resident) and kept.size == n
    (scanned,) = await actor.call("r1", "prefix_sum_f32", [kept])
    np.testing.assert_allclose(scanned, np.cumsum(expected, dtype=np.float64), rtol=1e-5)
    chained = await actor.call_graph("g3", document, {1: kept, 2: y}, [3])
    np.testing.assert_array_equal(chained[3], 2 * expected + y)
    assert await actor.forget("g2") == 2  # the graph call kept slots 3 and 4
    with pytest.raises(accy.LaunchArgumentMismatch, match="not a slot"):
        await actor.call_graph("g4", document, {9: x})
    with pytest.raises(accy.LaunchArgumentMismatch, match="LaunchGraphDocument"):
        await actor.call_graph("g5", accy.library.load_builtin("saxpy_f32"), {1: x})  # type: ignore[arg-type]

    problem = scan_problem(p.ArtifactFormat.CPU, 4096)
    result = await actor.tune(problem, None, QUICK)
    assert result.complete and result.winner is not None
    assert await actor.tuned_plans() == ["prefix_sum.f32"]
    await assert_checkpoint(actor.tuned_plans)
    z = np.arange(5000, dtype=np.float32) % 3
    (tuned,) = await actor.call("t1", "prefix_sum.f32", [z])
    np.testing.assert_allclose(tuned, np.cumsum(z, dtype=np.float64), rtol=1e-5)
    await assert_checkpoint(lambda: other.adopt("scan", result.tuned_document(problem)))
    (adopted,) = await other.call("t2", "scan", [z])
    np.testing.assert_array_equal(adopted, tuned)
    with pytest.raises(accy.LaunchArgumentMismatch, match="no plan named 'scan'") as raised:
        await actor.call("t3", "scan", [z])  # handed to the other actor only
    assert raised.value.path == "$.plan"
    with anyio.move_on_after(0):  # cancelled as it starts: its record goes when it ends
        await actor.call_graph("g6", document, {1: np.ones(n, np.float32), 2: y}, keep=True)
    await anyio.sleep(0.2)
    assert not actor._running
    with pytest.raises(accy.LaunchArgumentMismatch, match="pipeline problems"):
        await actor.tune(tuning_document(p.ArtifactFormat.CPU).kernels[0])  # type: ignore[arg-type]
    assert await actor.close() == 0 and await other.close() == 0


async def test_graphs_and_tuned_plans_through_the_router(cluster: None) -> None:
    actors = _actors(2)
    router = Router(actors, max_in_flight=2)
    n = 2000
    document = saxpy_graph(p.ArtifactFormat.CPU, n)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(24)]
    y = np.ones(n, np.float32)
    got: dict[int, np.ndarray[Any, Any]] = {}

    async def one(index: int) -> None:
        got[index] = (await router.call_graph(document, {1: inputs[index], 2: y}, read=[4]))[4]

    async with anyio.create_task_group() as group:
        for index in range(len(inputs)):
            group.start_soon(one, index)
    for index, x in enumerate(inputs):
        np.testing.assert_allclose(got[index], 0.5 * (2 * x + y) + x, rtol=1e-6)
    kept = (await router.call_graph(document, {1: inputs[0], 2: y}, keep=True))[4]
    (scanned,) = await router.call("prefix_sum_f32", kept)  # on the actor keeping it
    np.testing.assert_allclose(
        scanned, np.cumsum(0.5 * (2 * inputs[0] + y) + inputs[0], dtype=np.float64), rtol=1e-4
    )
    assert await router.release(kept) == 1

    problem = scan_problem(p.ArtifactFormat.CPU, 4096)
    result = await router.tune(problem, settings=QUICK)
    assert result.winner is not None
    assert [await actor.tuned_plans.remote() for actor in actors] == [["prefix_sum.f32"]] * 2
    z = np.arange(7000, dtype=np.float32) % 5
    for _ in range(6):  # both actors serve it
        (tuned,) = await router.call("prefix_sum.f32", z)
        np.testing.assert_allclose(tuned, np.cumsum(z, dtype=np.float64), rtol=1e-5)
    assert sum([await actor.served_count.remote() for actor in actors]) == 24 + 1 + 1 + 6
    assert await _close(actors) == [0, 0]
