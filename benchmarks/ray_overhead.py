"""What the Ray router adds per request, against the same call in-process.

A prefix sum of 1,000 int32 elements (NumPy in, NumPy out), one request after another and
64 at a time, through ``open_pipeline`` in this process, through a ``PipelineActorImpl`` in
this process (the actor's own bookkeeping), and through ``Router`` to one and to two Ray
actors. On the CPU backend (the default) each actor takes half a CPU; with
``--backend cuda`` each takes the GPU (one actor: ``num_gpus=1``; two share it, 0.5 each,
or with ``--gpus 2`` take one GPU each). ``--n`` sets the elements per request (larger
requests measure the devices, not Ray)::

    python benchmarks/ray_overhead.py --out benchmarks/results/
    python benchmarks/ray_overhead.py --backend cuda --out benchmarks/results/
    python benchmarks/ray_overhead.py --backend cuda --gpus 2 --n 1048576 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import ray

import accy_async as accy
from accy_async.ray import PipelineActor, PipelineActorImpl, Router
from accy_bench.provenance import git_revision

N = 1000
REQUESTS = 400
"""Requests per round for small requests; fewer for large ones (about 400 MB a round)."""
_requests = REQUESTS


async def _per_request_us(run: Any, concurrency: int) -> float:
    """Median over 5 rounds of µs per request, ``concurrency`` requests in flight."""
    samples = []
    for _ in range(6):
        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for worker in range(concurrency):
                group.start_soon(_loop, run, max(1, _requests // concurrency), worker)
        samples.append(
            (time.perf_counter() - start) / (concurrency * max(1, _requests // concurrency)) * 1e6
        )
    return statistics.median(samples[1:])


async def _loop(run: Any, count: int, worker: int) -> None:
    del worker
    for _ in range(count):
        await run()


async def measure(kind: str, n: int = N, gpus: int = 1) -> tuple[str, dict[str, float]]:
    """The device's name and µs per request of each way (two actors on ``gpus`` GPUs)."""
    global _requests
    _requests = max(64, min(REQUESTS, 100_000_000 // max(n, 1)))
    x = np.arange(n, dtype=np.int32) % 3
    rows: dict[str, float] = {}
    async with (
        accy.open_backend(kind) as backend,
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
        share = {"num_gpus": min(1, gpus / actors)} if kind == "cuda" else {"num_cpus": 0.5}
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
    parser.add_argument("--n", type=int, default=N, help="elements per request")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the actors may take (cuda)")
    args = parser.parse_args()
    ray.init(
        num_cpus=2 if args.backend == "cpu" else 4,
        num_gpus=args.gpus if args.backend == "cuda" else 0,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        device, rows = asyncio.run(measure(args.backend, args.n, args.gpus))
    finally:
        ray.shutdown()
    commit = git_revision()["commit"]
    result = {
        "commit": commit,
        "backend": args.backend,
        "machine": device,
        "n": args.n,
        "gpus": args.gpus if args.backend == "cuda" else 0,
        "ray": ray.__version__,
        "us_per_request": rows,
    }
    out = Path(args.out)
    stem = f"ray-overhead-{args.backend}"
    if args.n != N or (args.backend == "cuda" and args.gpus != 1):
        stem += f"-n{args.n}-gpus{args.gpus}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Ray router overhead ({args.backend} backend, {result['machine']})",
        "",
        f"commit {commit}; Ray {ray.__version__}; prefix sum of {args.n} int32; "
        f"µs per request (median of 5 rounds of {_requests})",
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
