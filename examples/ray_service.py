"""A scan service spread over Ray actors: clients send requests, the router fans them out.

Starts a local Ray cluster (or joins one with ``--address``), puts ``--actors`` actors
behind a router (one GPU each with ``--backend cuda``), and has ``--clients`` async
clients send ``--requests`` prefix sums each, of sizes from 1 to 100,000, checking every
answer against NumPy. Prints requests per second, how the requests spread over the
actors, and how many were wrong (0)::

    python examples/ray_service.py --backend cpu --actors 2 --clients 16 --requests 20
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import numpy as np
import ray

from accy_async.ray import PipelineActor, Router


async def serve(arguments: argparse.Namespace) -> int:
    gpus = 1 if arguments.backend == "cuda" else 0
    actors = [
        PipelineActor.options(num_gpus=gpus, num_cpus=0.5).remote(arguments.backend)
        for _ in range(arguments.actors)
    ]
    router = Router(actors, max_in_flight=arguments.in_flight)
    wrong = 0

    async def client(seed: int) -> None:
        nonlocal wrong
        rng = random.Random(seed)
        for _ in range(arguments.requests):
            n = int(10 ** rng.uniform(0, 5))
            x = np.arange(n, dtype=np.int32) % 13
            (y,) = await router.call("prefix_sum_i32", x)
            wrong += not np.array_equal(y, np.cumsum(x, dtype=np.int32))

    start = time.perf_counter()
    await asyncio.gather(*(client(seed) for seed in range(arguments.clients)))
    elapsed = time.perf_counter() - start
    served = [await actor.served_count.remote() for actor in actors]
    left = [await actor.close.remote() for actor in actors]
    total = arguments.clients * arguments.requests
    print(
        f"{total} requests from {arguments.clients} clients over {arguments.actors} actors "
        f"in {elapsed:.2f} s ({total / elapsed:.0f}/s); per actor {served}; "
        f"objects left on the backends {left}; {wrong} wrong"
    )
    return 0 if wrong == 0 and not any(left) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--in-flight", type=int, default=8, help="requests per actor at once")
    parser.add_argument("--address", help="a running Ray cluster's address (default: start one)")
    arguments = parser.parse_args()
    ray.init(
        address=arguments.address,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        return asyncio.run(serve(arguments))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
