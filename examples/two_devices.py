"""A launch graph spread over two devices: GPU 0 and GPU 1 where there are two.

Two built-in saxpy kernels as a graph whose first node runs on device 0 and second on
device 1: ``z = 2 * x + y`` on device 0, then ``w = 0.5 * z + x`` on device 1 (``z``
crosses to device 1 on the device, and ``x`` too, without the host). ``--clients``
tasks call it ``--requests`` times each with new arrays, and every answer is checked
against NumPy. With ``--backend cuda`` the devices are ``cuda:0`` and ``cuda:1``, or two
backends of ``cuda:0`` on a machine with one GPU (the same code path, one device's
speed); with ``--backend cpu`` two CPU backends (copies through the host)::

    python examples/two_devices.py --backend cpu --clients 4 --requests 10
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

import accy_async as accy
from accy_async import plan as p


def spread_saxpy(fmt: p.ArtifactFormat, n: int) -> p.LaunchGraphDocument:
    """``z = 2 x + y`` (slot 3) on device 0, then ``w = 0.5 z + x`` (slot 4) on device 1."""
    entry = next(
        each
        for each in accy.library.load_builtin("saxpy_f32").registry.entries
        if each.format is fmt
    )

    def saxpy(kernel_id: int, output: int, inputs: tuple[int, int], a: float) -> p.PlannedKernel:
        return p.PlannedKernel.from_entry(entry, kernel_id, output, inputs, (p.U32(n), p.F32(a)))

    slots = tuple(p.Slot(slot_id=i, byte_size=4 * n, dtype=p.DType.F32) for i in (1, 2, 3, 4))
    plan = p.ArtifactPlan(slots=slots, kernels=(saxpy(0, 3, (1, 2), 2.0), saxpy(1, 4, (3, 1), 0.5)))
    graph = p.LaunchGraphPlan(
        nodes=(p.GraphNode(kernel_index=0, device=0), p.GraphNode(kernel_index=1, device=1)),
        dependencies=(p.GraphDependency(producer_node_index=0, consumer_node_index=1),),
        device_count=2,
    )
    return p.LaunchGraphDocument(artifact_plan=plan, graph=graph)


def device_kinds(backend: str) -> tuple[str, str]:
    if backend == "auto":
        backend = accy.backends.auto_backend_choice()[0]
    if backend == "cpu":
        return "cpu", "cpu"
    from cuda.bindings import driver

    driver.cuInit(0)
    two = int(driver.cuDeviceGetCount()[1]) > 1
    return "cuda:0", "cuda:1" if two else "cuda:0"


async def main(arguments: argparse.Namespace) -> int:
    first, second = device_kinds(arguments.backend)
    n = arguments.n
    wrong = 0
    async with accy.open_backend(first) as zero, accy.open_backend(second) as one:
        fmt = zero.preferred_formats[0]
        if fmt is p.ArtifactFormat.CUDA_CUBIN:
            fmt = p.ArtifactFormat.CUDA_SOURCE  # the built-in kernels ship as CUDA C
        document = spread_saxpy(fmt, n)
        async with accy.open_graph(document, backend=[zero, one]) as run:

            async def client(seed: int) -> None:
                nonlocal wrong
                rng = np.random.default_rng(seed)
                for _ in range(arguments.requests):
                    x = rng.standard_normal(n).astype(np.float32)
                    y = rng.standard_normal(n).astype(np.float32)
                    out = await run({1: x, 2: y}, read=[4])
                    expected = np.float32(0.5) * (np.float32(2) * x + y) + x
                    wrong += not np.allclose(out[4], expected, rtol=1e-5, atol=1e-5)

            start = time.perf_counter()
            async with anyio.create_task_group() as tasks:
                for seed in range(arguments.clients):
                    tasks.start_soon(client, seed)
            elapsed = time.perf_counter() - start
    calls = arguments.clients * arguments.requests
    print(f"devices: {first} and {second}; {calls} calls of {n} elements in {elapsed:.2f} s")
    print(f"{calls / elapsed:.0f} calls/s, {wrong} wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("-n", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=20)
    raise SystemExit(anyio.run(main, parser.parse_args()))
