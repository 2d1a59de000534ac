"""What the Ray router adds per request, against the same call in-process (CPU backend).

A prefix sum of 1,000 int32 elements, one request after another and 64 at a time, through
``open_pipeline`` in this process, through a ``PipelineActorImpl`` in this process (the
actor's own bookkeeping), and through ``Router`` to one and to two Ray actors::

    python benchmarks/ray_overhead.py --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def measure() -> dict[str, float]:
    x = np.arange(N, dtype=np.int32)
    rows: dict[str, float] = {}
    async with (
        accy.open_backend("cpu") as backend,
        accy.open_pipeline("prefix_sum_i32", backend=backend) as scan,
    ):

        async def direct() -> None:
            await scan(x)

        for concurrency in (1, 64):
            rows[f"open_pipeline in process, {concurrency} in flight"] = await _per_request_us(
                direct, concurrency
            )
    actor_impl = PipelineActorImpl("cpu")
    counter = iter(range(10**9))

    async def bookkeeping() -> None:
        await actor_impl.call(str(next(counter)), "prefix_sum_i32", [x])

    rows["PipelineActorImpl in process, 1 in flight"] = await _per_request_us(bookkeeping, 1)
    await actor_impl.close()
    for actors in (1, 2):
        handles = [PipelineActor.options(num_cpus=0.5).remote("cpu") for _ in range(actors)]
        router = Router(handles)

        async def routed(router: Router = router) -> None:
            await router.call("prefix_sum_i32", x)

        for concurrency in (1, 64):
            rows[f"Router, {actors} Ray actor(s), {concurrency} in flight"] = await _per_request_us(
                routed, concurrency
            )
        for handle in handles:
            await handle.close.remote()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        rows = asyncio.run(measure())
    finally:
        ray.shutdown()
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    result = {"commit": commit, "n": N, "ray": ray.__version__, "us_per_request": rows}
    out = Path(args.out)
    (out / "ray-overhead-cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Ray router overhead (CPU backend, 2-core development machine)",
        "",
        f"commit {commit}; Ray {ray.__version__}; prefix sum of {N} int32; "
        "µs per request (median of 5 rounds of 400)",
        "",
        "| how | µs per request |",
        "|---|---|",
        *(f"| {name} | {us:.0f} |" for name, us in rows.items()),
    ]
    (out / "ray-overhead-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
