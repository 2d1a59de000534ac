"""The README's example: an inclusive prefix sum with `await launch_pipeline`.

Run it with ``python examples/quickstart.py`` (``--backend cpu`` to skip the GPU).
"""

from __future__ import annotations

import argparse

import anyio
import numpy as np

import accy_async as accy


async def main(backend_kind: accy.backends.BackendKind, n: int) -> None:
    document = accy.library.load_builtin("prefix_sum_f32")
    pipeline, registry = document.pipeline, document.registry
    scalars = (accy.U32(n),)
    x = np.ones(n, dtype=np.float32)
    async with accy.open_backend(backend_kind) as backend:
        pool = await accy.load_pipeline_artifacts(backend, pipeline, registry)
        scratch = await accy.allocate_pipeline_intermediates(backend, pipeline, scalars)
        source, result = accy.upload(backend, x), backend.allocate_buffer(4 * n)
        async with pool, scratch:
            await accy.launch_pipeline(
                backend,
                accy.PipelineLaunch.of(
                    document,  # checks the buffers against the plan's shapes first
                    operands=[source.bind("read_only")],
                    results=[result.bind()],
                    runtime_scalar_arguments=scalars,
                    intermediates=scratch,
                    artifacts=pool,
                ),
            )
            y = await accy.download(backend, result, np.float32, n)
        backend.destroy_all([source, result])
    assert np.array_equal(y, np.arange(1, n + 1, dtype=np.float32))
    print(f"prefix sum of {n} ones on {backend.kind}: ..., {y[-2]:.0f}, {y[-1]:.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("-n", type=int, default=1_000_000)
    args = parser.parse_args()
    anyio.run(main, args.backend, args.n)
