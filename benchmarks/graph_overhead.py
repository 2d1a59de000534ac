"""Scheduling overhead of ``launch_graph`` against a plain loop over the backend, same run.

A 10,000-node graph of a no-op kernel is enqueued two ways on each backend:

* ``plain``: a Python loop calling ``backend.launch`` with arguments built
  beforehand (and, for the multi-stream graph, the same ``create_event`` /
  ``record_event`` / wait-event calls the runner makes);
* ``graph``: ``await launch_graph(...)`` on the equivalent plan.

Both are timed from the first enqueue until the last launch has returned
(enqueue time; the host cost this issue is about) and until the device has
finished (end to end). Each variant runs ``--repeat`` times; medians are
reported with their ratio. Usage::

    python benchmarks/graph_overhead.py [--nodes 10000] [--repeat 5] [--backends recording cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import accy_async as accy
from accy_async import plan as p
from accy_async.graph import launch_graph
from accy_async.kernels import SlotBinding, load_kernels

RESULTS = Path(__file__).parent / "results"


@accy.cpu_kernel("bench.noop")
def noop(ctx: accy.CpuLaunchContext, out: np.ndarray, src: np.ndarray, n: int) -> None:
    """Does nothing: the benchmark measures scheduling, not work."""


NOOP_CUDA = """extern "C" __global__ void noop(float* out, const float* in, unsigned n) {}"""


def artifact_spec(backend: accy.Backend) -> p.ArtifactSpec:
    if p.ArtifactFormat.CPU in backend.preferred_formats[:1]:
        payload: p.Payload = p.CpuKernelPayload("bench.noop")
        fmt = p.ArtifactFormat.CPU
    else:
        payload, fmt = p.TextPayload(NOOP_CUDA), p.ArtifactFormat.CUDA_SOURCE
    return p.ArtifactSpec(
        kernel_name="noop", format=fmt, payload=payload, argument_count=3, scalar_argument_count=1
    )


def graph_plan(nodes: int, streams: int) -> p.LaunchGraphPlan:
    """A chain over ``streams`` streams: node i on stream i % streams, each after node i-1."""
    if streams <= 1:
        return p.LaunchGraphPlan(nodes=tuple(p.GraphNode(kernel_index=0) for _ in range(nodes)))
    return p.LaunchGraphPlan(
        nodes=tuple(p.GraphNode(kernel_index=0, stream=i % streams) for i in range(nodes)),
        dependencies=tuple(
            p.GraphDependency(producer_node_index=i, consumer_node_index=i + 1)
            for i in range(nodes - 1)
        ),
        stream_count=streams,
    )


async def measure(backend: accy.Backend, nodes: int, streams: int, repeat: int) -> dict[str, Any]:
    spec = artifact_spec(backend)
    plan = p.ArtifactPlan(
        slots=(p.Slot(slot_id=1, byte_size=256), p.Slot(slot_id=2, byte_size=256)),
        kernels=(
            p.PlannedKernel(
                kernel_id=1,
                work_item_id=1,
                artifact=spec,
                output_slot_id=2,
                input_slot_ids=(1,),
                runtime_scalar_argument_count=1,
                runtime_scalar_defaults=(p.U32(64),),
                launch_resources=p.LaunchResources(geometry=p.LaunchGeometry(block=(64, 1, 1))),
            ),
        ),
    )
    graph = graph_plan(nodes, streams)
    src, dst = backend.allocate_buffer(256), backend.allocate_buffer(256)
    bindings = [SlotBinding(1, src.bind()), SlotBinding(2, dst.bind())]
    stream_handles = [backend.create_stream() for _ in range(max(streams, 1))]
    kernels = await load_kernels(backend, plan)
    loaded = kernels.loaded[0]
    buffers = [dst.bind("write_only"), src.bind("read_only")]
    scalars = [p.U32(64)]
    grid, block = (1, 1, 1), (64, 1, 1)

    config = accy.LaunchConfig(grid, block)

    async def plain() -> None:
        if streams <= 1:
            for _ in range(nodes):
                backend.launch(loaded, buffers, scalars, config)
            return
        events = [backend.create_event() for _ in range(nodes - 1)]
        previous = None
        for index in range(nodes):
            stream = stream_handles[index % streams]
            backend.launch(
                loaded,
                buffers,
                scalars,
                config,
                stream=stream,
                wait_events=() if previous is None else (previous,),
            )
            if index < nodes - 1:
                backend.record_event(events[index], stream)
                previous = events[index]
        backend.defer_destroy(events, after=stream_handles)

    async def through_graph() -> None:
        await launch_graph(kernels, bindings, graph, streams=stream_handles)

    async def timed(run: Callable[[], Awaitable[None]]) -> tuple[float, float]:
        await accy.synchronize(backend)
        backend.collect_deferred()
        start = time.perf_counter()
        await run()
        enqueued = time.perf_counter()
        for stream in stream_handles:
            await accy.wait_stream(backend, stream)
        await accy.wait_stream(backend)
        return enqueued - start, time.perf_counter() - start

    await timed(plain)  # warm up both paths (schedules, caches)
    await timed(through_graph)
    samples: dict[str, list[tuple[float, float]]] = {"plain": [], "graph": []}
    for _ in range(repeat):
        samples["plain"].append(await timed(plain))
        samples["graph"].append(await timed(through_graph))
    await kernels.aclose()
    await accy.synchronize(backend)
    backend.collect_deferred()
    backend.destroy_all([src, dst, *stream_handles])
    result: dict[str, Any] = {"backend": backend.kind, "nodes": nodes, "streams": streams}
    for phase, position in (("enqueue", 0), ("end_to_end", 1)):
        plain_s = statistics.median(sample[position] for sample in samples["plain"])
        graph_s = statistics.median(sample[position] for sample in samples["graph"])
        result[phase] = {
            "plain_us_per_node": plain_s / nodes * 1e6,
            "graph_us_per_node": graph_s / nodes * 1e6,
            "ratio": graph_s / plain_s,
        }
    return result


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for kind in args.backends:
        async with accy.open_backend(kind) as backend:
            for streams in (1, 2, 4):
                results.append(await measure(backend, args.nodes, streams, args.repeat))
                row = results[-1]
                print(
                    f"{kind:10s} streams={streams} "
                    f"enqueue {row['enqueue']['plain_us_per_node']:.2f} -> "
                    f"{row['enqueue']['graph_us_per_node']:.2f} us/node "
                    f"(x{row['enqueue']['ratio']:.2f}); end to end "
                    f"x{row['end_to_end']['ratio']:.2f}",
                    flush=True,
                )
    return results


def markdown(results: list[dict[str, Any]], nodes: int) -> str:
    lines = [
        f"# launch_graph scheduling overhead ({nodes} nodes, median of runs)",
        "",
        f"Python {platform.python_version()} on {platform.machine()}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| backend | streams | plain loop µs/node | launch_graph µs/node | ratio (enqueue) "
        "| ratio (end to end) |",
        "|---|---|---|---|---|---|",
    ]
    lines.extend(
        f"| {row['backend']} | {row['streams']} | {row['enqueue']['plain_us_per_node']:.2f} "
        f"| {row['enqueue']['graph_us_per_node']:.2f} | {row['enqueue']['ratio']:.2f} "
        f"| {row['end_to_end']['ratio']:.2f} |"
        for row in results
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["recording", "cpu"])
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="where to write JSON and Markdown (default: benchmarks/results/)",
    )
    args = parser.parse_args()
    results = anyio.run(main_async, args)
    target = args.output or RESULTS
    target.mkdir(parents=True, exist_ok=True)
    stem = "graph_overhead-" + "-".join(args.backends)
    (target / f"{stem}.json").write_text(
        json.dumps(
            {"python": sys.version, "date": time.strftime("%Y-%m-%d"), "results": results}, indent=2
        )
    )
    (target / f"{stem}.md").write_text(markdown(results, args.nodes))


if __name__ == "__main__":
    main()
