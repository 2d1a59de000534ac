"""``accy-async demo``: a prefix sum of N elements on the default backend, checked and timed.

Runs the library's prefix sum (``prefix_sum_f32``: one pass, decoupled
look-back) with a loaded pool and scratch, a few times, checks the result
against NumPy and prints the best time per scan, the memory bandwidth it
reached (8 bytes per element: one read, one write) and, where the device
reports it, the device's own (one JSON object with ``--json``). Each timed run
enqueues a batch of scans and waits once, so the time is the device's, not
the wake-up's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

import anyio
import numpy as np

from . import library
from .backends import auto_backend_choice, open_backend
from .buffers import download, upload
from .cli_arguments import BACKEND_HELP, Progress, backend_kind, positive_int
from .pipeline import (
    PipelineLaunch,
    allocate_pipeline_intermediates,
    choose_format,
    launch_pipeline,
    load_pipeline_artifacts,
)
from .plan import ScalarArgument, scalar
from .tracing import trace
from .waiting import wait_stream

__all__ = ["add_demo_parser", "demo"]

_BATCH_SECONDS = 0.005
"""About how long each timed batch of scans runs (so the wait's wake-up is a small part)."""
_MAX_BATCH = 200


def add_demo_parser(commands: Any) -> None:
    """Add the ``demo`` sub-command to ``commands`` (an argparse sub-parsers object)."""
    command = commands.add_parser("demo", help="prefix sum on the default backend, verified")
    command.add_argument(
        "-n", type=positive_int, default=10_000_003, help="elements (default 10,000,003)"
    )
    command.add_argument("--backend", type=backend_kind, default="auto", help=BACKEND_HELP)
    command.add_argument(
        "--repeat",
        type=positive_int,
        default=5,
        help="timed batches of scans; the best is shown (default 5)",
    )
    command.add_argument("--seed", type=int, default=0, help="seed of the random input")
    command.add_argument("--json", action="store_true", help="print one JSON object")
    command.add_argument(
        "--trace",
        metavar="FILE",
        help="write the last timed batch as a Chrome trace (open it in https://ui.perfetto.dev)",
    )
    command.add_argument("--quiet", action="store_true", help="no progress on stderr")


async def demo(args: argparse.Namespace) -> int:
    """Run ``demo``; the exit status (1 if the sum did not match NumPy's)."""
    progress = Progress(sys.stderr, quiet=args.quiet)
    n = args.n
    if args.backend == "auto":
        choice, reason = auto_backend_choice()
        progress.step(f"auto backend: {choice} ({reason})")
    document = library.load_builtin("prefix_sum_f32")
    rng = np.random.default_rng(args.seed)
    values = rng.integers(0, 4, n).astype(np.float32)  # sums stay exact in float32 up to 2**22
    expected = np.cumsum(values.astype(np.float64))
    async with open_backend(args.backend) as backend:
        progress.step(f"backend: {backend.name}")
        fmt = choose_format(backend, document)
        scalars: tuple[ScalarArgument, ...] = (scalar("u32", n),)
        stages = len(document.pipeline.stages)
        progress.step(f"loading the prefix sum, {stages} stages ({fmt.value})")
        pool = await load_pipeline_artifacts(backend, document.pipeline, document.registry, fmt)
        scratch = await allocate_pipeline_intermediates(backend, document.pipeline, scalars)
        source = upload(backend, values)
        result = backend.allocate_buffer(4 * n)
        async with pool, scratch:
            request = PipelineLaunch(
                pipeline=document.pipeline,
                registry=document.registry,
                format=fmt,
                operands=[source.bind("read_only")],
                results=[result.bind()],
                runtime_scalar_arguments=scalars,
                intermediates=scratch,
                artifacts=pool,
            )
            start = time.perf_counter()
            await launch_pipeline(backend, request)  # warm: the kernels' first run
            await wait_stream(backend)
            batch = min(_MAX_BATCH, max(1, round(_BATCH_SECONDS / (time.perf_counter() - start))))
            times = []
            for repeat in range(args.repeat):
                traced = args.trace is not None and repeat == args.repeat - 1
                with trace(backend) if traced else contextlib.nullcontext() as tracer:
                    start = time.perf_counter()
                    for _ in range(batch):
                        await launch_pipeline(backend, request)
                    await wait_stream(backend)
                    times.append((time.perf_counter() - start) / batch)
                if tracer is not None:  # the work is done: its device times are in
                    await anyio.to_thread.run_sync(tracer.write, args.trace)
                    progress.step(f"trace of the last batch: {args.trace}")
                scans = f"{batch} scans" if batch > 1 else "1 scan"
                progress.step(
                    f"run {repeat + 1}/{args.repeat}: {scans}, {times[-1] * 1e3:.3f} ms each"
                )
            got = await download(backend, result, np.float32, n)
        backend.destroy_all([source, result])
        name = backend.name
        kind = backend.kind
        peak = backend.peak_memory_bandwidth
    exact = bool(np.array_equal(got.astype(np.float64), expected)) if n <= 2**22 else None
    close = bool(np.allclose(got, expected, rtol=1e-5, atol=1e-2))
    best = min(times)
    reached = 2 * 4 * n / best
    report = {
        "backend": kind,
        "device": name,
        "n": n,
        "best_ms": best * 1e3,
        "elements_per_second": n / best,
        "gigabytes_per_second": reached / 1e9,
        "device_peak_gigabytes_per_second": None if peak is None else peak / 1e9,
        "fraction_of_peak": None if peak is None else reached / peak,
        "verified": close and exact is not False,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"accy-async demo: inclusive prefix sum of {n:,} float32 on {kind} ({name})")
        print(f"  time:       {best * 1e3:.3f} ms (best of {args.repeat})")
        print(f"  throughput: {n / best / 1e6:,.1f} M elements/s")
        device = "" if peak is None else f"; the device's peak: {peak / 1e9:,.0f} GB/s"
        share = "" if peak is None else f" ({reached / peak:.0%})"
        print(f"  bandwidth:  {reached / 1e9:,.1f} GB/s{share}, read + write{device}")
        print(f"  checked against NumPy: {'OK' if report['verified'] else 'MISMATCH'}")
    return 0 if report["verified"] else 1
