"""What the Ray router adds per request, against the same call in-process.

A prefix sum of 1,000 int32 elements (NumPy in, NumPy out), one request after another and
64 at a time, through ``open_pipeline`` in this process, through a ``PipelineActorImpl`` in
this process (the actor's own bookkeeping), and through ``Router`` to one and to two Ray
actors. On the CPU backend (the default) each actor takes half a CPU; with
``--backend cuda`` each takes the GPU (one actor: ``num_gpus=1``; two share it, 0.5 each)::

    python benchmarks/ray_overhead.py --out benchmarks/results/
    python benchmarks/ray_overhead.py --backend cuda --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import ray

import accy_async as accy
from accy_async.ray import PipelineActor, PipelineActorImpl, Router

N = 1000
REQUESTS = 400


async def _per_request_us(run: Any, concurrency: int) -> float:
    """Median over 5 rounds of µs per request, ``concurrency`` requests in flight."""
    samples = []
    for _ in range(6):
        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for worker in range(concurrency):
                group.start_soon(_loop, run, REQUESTS // concurrency, worker)
        samples.append((time.perf_counter() - start) / REQUESTS * 1e6)
    return statistics.median(samples[1:])


async def _loop(run: Any, count: int, worker: int) -> None:
    del worker
    for _ in range(count):
        await run()


async def measure(kind: str) -> tuple[str, dict[str, float]]:
    """The device's name and µs per request of each way."""
    x = np.arange(N, dtype=np.int32)
    rows: dict[str, float] = {}
    async with (
        accy.open_backend(kind) as backend,  # type: ignore[arg-type]
        accy.open_pipeline("prefix_sum_i32", backend=backend) as scan,
    ):
        device = f"{backend.name}, {os.cpu_count()} cores"

        async def direct() -> None:
            await scan(x)

        for concurrency in (1, 64):
            name = f"open_pipeline in process, {concurrency} in flight"
            rows[name] = await _per_request_us(direct, concurrency)
            print(f"{name}: {rows[name]:.0f} µs", flush=True)
    actor_impl = PipelineActorImpl(kind)
    counter = iter(range(10**9))

    async def bookkeeping() -> None:
        await actor_impl.call(str(next(counter)), "prefix_sum_i32", [x])

    rows["PipelineActorImpl in process, 1 in flight"] = await _per_request_us(bookkeeping, 1)
    await actor_impl.close()
    for actors in (1, 2):
        share = {"num_gpus": 1 / actors} if kind == "cuda" else {"num_cpus": 0.5}
        handles = [PipelineActor.options(**share).remote(kind) for _ in range(actors)]
        router = Router(handles)

        async def routed(router: Router = router) -> None:
            await router.call("prefix_sum_i32", x)

        for concurrency in (1, 64):
            name = f"Router, {actors} Ray actor(s), {concurrency} in flight"
            rows[name] = await _per_request_us(routed, concurrency)
            print(f"{name}: {rows[name]:.0f} µs", flush=True)
        for handle in handles:
            await handle.close.remote()
            ray.kill(handle)  # gives its share of the GPU back for the next actors
    return device, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    ray.init(
        num_cpus=2 if args.backend == "cpu" else 4,
        num_gpus=1 if args.backend == "cuda" else 0,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        device, rows = asyncio.run(measure(args.backend))
    finally:
        ray.shutdown()
    commit = (
        os.environ.get("ACCY_REVISION")
        or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    )
    result = {
        "commit": commit,
        "backend": args.backend,
        "machine": device,
        "n": N,
        "ray": ray.__version__,
        "us_per_request": rows,
    }
    out = Path(args.out)
    stem = f"ray-overhead-{args.backend}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Ray router overhead ({args.backend} backend, {result['machine']})",
        "",
        f"commit {commit}; Ray {ray.__version__}; prefix sum of {N} int32; "
        "µs per request (median of 5 rounds of 400)",
        "",
        "| how | µs per request |",
        "|---|---|",
        *(f"| {name} | {us:.0f} |" for name, us in rows.items()),
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
