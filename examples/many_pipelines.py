"""Run 1,000 prefix-sum pipelines concurrently, sharing one pool, and check every result.

Each task has its own operands, result and intermediates and launches on one of a few
streams; every one awaits its own completion without blocking the others.

    python examples/many_pipelines.py [--count 1000] [--backend auto|cuda|cpu]
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

import accy_async as accy


async def main(backend_kind: accy.backends.BackendKind, count: int, streams: int) -> int:
    document = accy.library.load_builtin("prefix_sum_i32")
    pipeline, registry = document.pipeline, document.registry
    wrong: list[int] = []
    async with accy.open_backend(backend_kind) as backend:
        lanes = [backend.create_stream() for _ in range(streams)]
        start = time.perf_counter()
        async with await accy.load_pipeline_artifacts(backend, pipeline, registry) as pool:

            async def one(task: int) -> None:
                n = 1 + (task * 7919) % 20_000
                values = np.random.default_rng(task).integers(-50, 50, n, dtype=np.int32)
                stream = lanes[task % streams]
                scalars = (accy.U32(n),)
                source = accy.upload(backend, values, stream=stream)
                result = backend.allocate_buffer(4 * n)
                async with await accy.allocate_pipeline_intermediates(
                    backend, pipeline, scalars
                ) as scratch:
                    await accy.launch_pipeline(
                        backend,
                        accy.PipelineLaunch(
                            pipeline=pipeline,
                            registry=registry,
                            operands=[source.bind("read_only")],
                            results=[result.bind()],
                            runtime_scalar_arguments=scalars,
                            intermediates=scratch,
                            artifacts=pool,
                            stream=stream,
                        ),
                    )
                    got = await accy.download(backend, result, np.int32, n, stream=stream)
                backend.destroy_all([source, result])
                if not np.array_equal(got, np.cumsum(values, dtype=np.int32)):
                    wrong.append(task)

            async with anyio.create_task_group() as group:
                for task in range(count):
                    group.start_soon(one, task)
        elapsed = time.perf_counter() - start
        backend.destroy_all(lanes)
        kind = backend.kind
    print(
        f"{count} concurrent pipelines on {kind}: {count - len(wrong)} correct, "
        f"{len(wrong)} wrong, {elapsed:.2f} s"
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    raise SystemExit(anyio.run(main, args.backend, args.count, args.streams))
