"""``accy-async bench kernels``: the built-in kernels' device time beside PyTorch and CuPy.

For each size ``n`` (1e3 to 1e9 by default) and each kernel, the median device
time of one call, from CUDA events recorded on one stream around it, for:

* the inclusive scan of int32 and float32: accy-async's ``prefix_sum_i32`` and
  ``prefix_sum_f32`` (one pass, decoupled look-back), its three-stage reference
  ``prefix_sum_i32_three_stage``, ``torch.cumsum`` and ``cupy.cumsum``;
* the sum of float32: ``sum_f32``, ``torch.sum`` and ``cupy.sum``;
* saxpy of float32: ``saxpy_f32`` and ``torch.add(y, x, alpha=a)``;

beside the bandwidth floor: the bytes a kernel must move (8 per element for a
scan, 4 for a sum, 12 for saxpy) at 4 TB/s and at the device's own peak.

Every call is enqueued behind a ~1 ms sleeping kernel, so the events time
the device, not the host's launch (an accy-async call with PyTorch tensors
takes 70-100 µs of host time on the H200's host). Each call runs once
untimed first (it compiles and warms the caches), and each accy-async result
is compared with a float64 or int64 reference. Arrays of up to 1e6 elements fit the H200's
50 MB L2 cache, so times there are latency and cache, not memory bandwidth.
Needs PyTorch on a CUDA device; CuPy's rows appear where it is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

import accy_async as accy

from .provenance import describe_run
from .rig import Rig

__all__ = ["FLOOR_BYTES_PER_SECOND", "SIZES", "main", "markdown", "run_kernels"]

SIZES = (10**3, 10**4, 10**5, 10**6, 10**7, 10**8, 10**9)
FLOOR_BYTES_PER_SECOND = 4e12
"""The bandwidth the issue's targets count against (4 TB/s)."""
_SLEEP_CYCLES = 2_000_000
"""About 1 ms of a sleeping kernel before each call: longer than any call's host side."""
_BYTES_PER_ELEMENT = {"scan i32": 8, "scan f32": 8, "sum f32": 4, "saxpy f32": 12}

Enqueue = Callable[[], Awaitable[Any] | Any]
Check = Callable[[], bool]


def _samples(n: int) -> int:
    return 30 if n <= 10**7 else 10 if n <= 10**8 else 5


class _Timer:
    """Device time of calls enqueued on one PyTorch stream, which accy-async adopts."""

    def __init__(self, torch: Any, stream: Any, backend: accy.Backend) -> None:
        self.torch, self.stream, self.backend = torch, stream, backend
        self.adopted = backend.adopt_stream(stream)

    async def device_ms(self, enqueue: Enqueue, samples: int) -> list[float]:
        """Device milliseconds of ``enqueue``, once per sample."""
        torch = self.torch
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(samples)
        ]
        with torch.cuda.stream(self.stream):
            for start, end in pairs:
                torch.cuda._sleep(_SLEEP_CYCLES)
                start.record(self.stream)
                pending = enqueue()
                if inspect.isawaitable(pending):  # accy-async's call; the others return arrays
                    await pending
                end.record(self.stream)
        await accy.wait_stream(self.backend, self.adopted)
        return [start.elapsed_time(end) for start, end in pairs]

    def close(self) -> None:
        self.backend.destroy(self.adopted)  # adopted: forgotten, not destroyed


async def run_kernels(sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Measure every row; the results as plain data."""
    import torch

    try:
        import cupy
    except ImportError:
        cupy = None
    rig = Rig()
    try:
        result: dict[str, Any] = describe_run(rig)
    finally:
        rig.close()
    rows: list[dict[str, Any]] = []
    async with accy.open_backend("cuda") as backend:
        result["peak_bytes_per_second"] = backend.peak_memory_bandwidth
        result["floor_bytes_per_second"] = FLOOR_BYTES_PER_SECOND
        timer = _Timer(torch, torch.cuda.Stream(), backend)
        names = (
            "prefix_sum_i32",
            "prefix_sum_i32_three_stage",
            "prefix_sum_f32",
            "sum_f32",
            "saxpy_f32",
        )
        try:
            async with contextlib.AsyncExitStack() as calls_open:
                calls = {
                    name: await calls_open.enter_async_context(
                        accy.open_pipeline(name, backend=backend)
                    )
                    for name in names
                }
                for n in sizes:
                    rows += await _rows_of_size(timer, cupy, calls, n)
                    print(f"n={n:,}: done", flush=True)
        finally:
            timer.close()
    result["rows"] = rows
    return result


async def _rows_of_size(
    timer: _Timer, cupy: Any, calls: dict[str, Any], n: int
) -> list[dict[str, Any]]:
    torch, stream = timer.torch, timer.stream
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(n)
    with torch.cuda.stream(stream):
        ints = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=device,
                             generator=generator)  # fmt: skip
        x = torch.rand(n, dtype=torch.float32, device=device, generator=generator)
        y = torch.rand(n, dtype=torch.float32, device=device, generator=generator)
        out_i, theirs_i = torch.empty_like(ints), torch.empty_like(ints)
        out_f, theirs_f = torch.empty_like(x), torch.empty_like(x)
        total, theirs_total = torch.empty(1, device=device), torch.empty(1, device=device)
        exact_i = torch.cumsum(ints.to(torch.int64), 0).to(torch.int32)
        exact_f = torch.cumsum(x.to(torch.float64), 0)
        exact_total = x.to(torch.float64).sum()
        exact_saxpy = 2.0 * x + y

    def ours(name: str, *operands: Any, out: Any, **scalars: Any) -> Enqueue:
        return lambda: calls[name](*operands, out=out, stream=stream, **scalars)

    def close(got: Any, expected: Any, rtol: float) -> Check:
        return lambda: bool(torch.allclose(got.to(expected.dtype), expected, rtol=rtol))

    def equal(got: Any, expected: Any) -> Check:
        return lambda: bool(torch.equal(got, expected))

    plans: list[tuple[str, str, Enqueue, Check | None]] = [
        ("scan i32", "accy prefix_sum_i32", ours("prefix_sum_i32", ints, out=out_i),
         equal(out_i, exact_i)),
        ("scan i32", "accy prefix_sum_i32_three_stage",
         ours("prefix_sum_i32_three_stage", ints, out=out_i), equal(out_i, exact_i)),
        ("scan i32", "torch.cumsum",
         lambda: torch.cumsum(ints, 0, dtype=torch.int32, out=theirs_i), None),
        ("scan f32", "accy prefix_sum_f32", ours("prefix_sum_f32", x, out=out_f),
         close(out_f, exact_f, 1e-4)),
        ("scan f32", "torch.cumsum", lambda: torch.cumsum(x, 0, out=theirs_f), None),
        ("sum f32", "accy sum_f32", ours("sum_f32", x, out=total),
         close(total[0], exact_total, 1e-5)),
        ("sum f32", "torch.sum", lambda: torch.sum(x, 0, keepdim=True, out=theirs_total), None),
        ("saxpy f32", "accy saxpy_f32", ours("saxpy_f32", x, y, out=out_f, a=2.0),
         close(out_f, exact_saxpy, 1e-6)),
        ("saxpy f32", "torch.add(y, x, alpha=a)",
         lambda: torch.add(y, x, alpha=2.0, out=theirs_f), None),
    ]  # fmt: skip
    if cupy is not None:
        plans += _cupy_plans(cupy, stream, ints, x)
    rows = []
    for kernel, implementation, enqueue, check in plans:
        await timer.device_ms(enqueue, 1)  # compile, warm
        times = await timer.device_ms(enqueue, _samples(n))
        median = statistics.median(times)
        rows.append(
            {
                "kernel": kernel,
                "implementation": implementation,
                "n": n,
                "median_ms": median,
                "min_ms": min(times),
                "bytes_per_second": _BYTES_PER_ELEMENT[kernel] * n / (median * 1e-3),
                "checked": None if check is None else check(),
            }
        )
    return rows


def _cupy_plans(
    cupy: Any, stream: Any, ints: Any, x: Any
) -> list[tuple[str, str, Enqueue, Check | None]]:
    """CuPy's scan and sum of the same arrays, zero-copy, on the same stream."""
    on_stream = cupy.cuda.ExternalStream(stream.cuda_stream)
    with on_stream:
        c_ints, c_x = cupy.from_dlpack(ints), cupy.from_dlpack(x)
        out_i, out_f = cupy.empty_like(c_ints), cupy.empty_like(c_x)
        total = cupy.empty((), dtype=cupy.float32)

    def on_cupy(body: Callable[[], Any]) -> Enqueue:
        def enqueue() -> None:
            with on_stream:
                body()

        return enqueue

    return [
        ("scan i32", "cupy.cumsum",
         on_cupy(lambda: cupy.cumsum(c_ints, dtype=cupy.int32, out=out_i)), None),
        ("scan f32", "cupy.cumsum", on_cupy(lambda: cupy.cumsum(c_x, out=out_f)), None),
        ("sum f32", "cupy.sum", on_cupy(lambda: cupy.sum(c_x, out=total)), None),
    ]  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    """The results as one Markdown table per kernel."""
    peak = result.get("peak_bytes_per_second")
    floor = result["floor_bytes_per_second"]
    reported = f" (the device reports a peak of {peak / 1e9:,.0f} GB/s)" if peak else ""
    lines = [
        f"# Built-in kernels on {result['device']}",
        "",
        f"{result['date']}; commit {result['git']['commit']}"
        + (" (with uncommitted changes)" if result["git"]["dirty"] else "")
        + "; "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        "",
        "Median device time of one call in ms (CUDA events on one stream, each call behind a "
        "~1 ms sleeping kernel, so no host time is counted). GB/s and the share of 4 TB/s "
        "count the bytes the kernel must move"
        f"{reported}. Up to 1e6 elements the arrays fit the L2 cache. 'x torch' is the first "
        "column's time over PyTorch's; 'checked': its result against a float64 or int64 "
        "reference.",
    ]
    by_kernel: dict[str, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        by_kernel.setdefault(row["kernel"], []).append(row)
    for kernel, rows in by_kernel.items():
        implementations = list(dict.fromkeys(row["implementation"] for row in rows))
        accy_name = implementations[0]
        lines += [
            "",
            f"## {kernel} ({_BYTES_PER_ELEMENT[kernel]} bytes per element)",
            "",
            "| n | "
            + " | ".join(implementations)
            + f" | floor at 4 TB/s | {accy_name} GB/s | of 4 TB/s | x torch | checked |",
            "|---" * (len(implementations) + 6) + "|",
        ]
        for n in dict.fromkeys(row["n"] for row in rows):
            cells = {row["implementation"]: row for row in rows if row["n"] == n}
            ours = cells[accy_name]
            torch_row = next((r for name, r in cells.items() if name.startswith("torch")), None)
            ratio = ours["median_ms"] / torch_row["median_ms"] if torch_row else float("nan")
            moved = _BYTES_PER_ELEMENT[kernel] * n
            lines.append(
                f"| {n:.0e} | "
                + " | ".join(
                    f"{cells[name]['median_ms']:.4f}" if name in cells else ""
                    for name in implementations
                )
                + f" | {moved / floor * 1e3:.4f} | {ours['bytes_per_second'] / 1e9:,.0f} | "
                f"{ours['bytes_per_second'] / floor:.0%} | {ratio:.2f} | "
                f"{'yes' if ours['checked'] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the kernel benchmark; write ``kernels.json`` and ``kernels.md`` to ``--out``."""
    parser = argparse.ArgumentParser(
        prog="accy-async bench kernels", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default=".", help="folder for kernels.json and kernels.md")
    parser.add_argument(
        "--sizes", type=float, nargs="+", default=list(SIZES), help="element counts (1e3 ... 1e9)"
    )
    args = parser.parse_args(argv)
    result = anyio.run(run_kernels, tuple(int(n) for n in args.sizes))
    from . import plots

    plots.write_with_figures(
        result, markdown(result), Path(args.out), "kernels", plots.plot_kernels
    )
    return 0
