"""Copies between two CUDA backends (two GPUs where there are two) against raw cuMemcpyPeerAsync.

For each size, ``COPIES`` copies from a buffer of device ``--source`` to one of device
``--target`` back to back, then one wait: through ``accy.copy_between`` (each copy
ordered after the source stream by a device-side event wait, then ``cuMemcpyPeerAsync``)
and through the raw driver call on the same buffers and streams, alternating, in the same
run. Reports GB/s (median of ``ROUNDS``) and the host's µs per copy call::

    python benchmarks/peer_copy.py --out DIR                  # device 0 -> 1 if there are 2
    python benchmarks/peer_copy.py --source 0 --target 0      # one GPU: a copy within it

On one GPU (source and target both 0) the numbers are a same-device copy through the peer
path, not a peer copy: they prove the path, not NVLink.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

import accy_async as accy
from accy_bench.provenance import git_revision

SIZES = (4 << 10, 1 << 20, 64 << 20, 256 << 20)
COPIES = 20
ROUNDS = 7


async def measure(source_ordinal: int, target_ordinal: int) -> dict[str, Any]:
    from cuda.bindings import driver as d

    rows: list[dict[str, Any]] = []
    async with (
        accy.open_backend(f"cuda:{source_ordinal}") as source,
        accy.open_backend(f"cuda:{target_ordinal}") as target,
    ):
        after, stream = source.create_stream(), target.create_stream()
        source_context = source._context  # type: ignore[attr-defined]
        target_context = target._context  # type: ignore[attr-defined]
        can = int(d.cuDeviceCanAccessPeer(target._device, source._device)[1])  # type: ignore[attr-defined]
        for size in SIZES:
            src, dst = source.allocate_buffer(size), target.allocate_buffer(size)
            source.fill_buffer(src, 0x3F800000, stream=after)
            await accy.wait_stream(source, after)

            async def through_accy(src: Any = src, dst: Any = dst, size: int = size) -> float:
                start = time.perf_counter()
                for _ in range(COPIES):
                    await accy.copy_between(
                        source, src, target, dst, size, after=after, stream=stream
                    )
                enqueued = time.perf_counter() - start
                await accy.wait_stream(target, stream)
                return enqueued

            async def raw(src: Any = src, dst: Any = dst, size: int = size) -> float:
                start = time.perf_counter()
                for _ in range(COPIES):
                    d.cuMemcpyPeerAsync(
                        dst.address,
                        target_context,
                        src.address,
                        source_context,
                        size,
                        stream.native,
                    )
                enqueued = time.perf_counter() - start
                await accy.wait_stream(target, stream)
                return enqueued

            samples: dict[str, list[tuple[float, float]]] = {"accy": [], "raw": []}
            for way in (through_accy, raw):  # warm-up
                await way()
            for _ in range(ROUNDS):
                for name, way in (("accy", through_accy), ("raw", raw)):
                    start = time.perf_counter()
                    enqueued = await way()
                    samples[name].append((time.perf_counter() - start, enqueued))
            row: dict[str, Any] = {"bytes": size}
            for name, pairs in samples.items():
                wall = statistics.median(total for total, _ in pairs)
                host = statistics.median(enqueued for _, enqueued in pairs)
                row[f"{name}_gb_s"] = size * COPIES / wall / 1e9
                row[f"{name}_host_us_per_copy"] = host / COPIES * 1e6
            rows.append(row)
            source.destroy(src)
            target.destroy(dst)
        await accy.synchronize(target)
        source.destroy(after)
        target.destroy(stream)
        return {
            "source": f"{source_ordinal}: {source.name}",
            "target": f"{target_ordinal}: {target.name}",
            "peer_access": bool(can) and source_ordinal != target_ordinal,
            "rows": rows,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--source", type=int, default=0)
    parser.add_argument("--target", type=int, default=None, help="default: 1 if there are two")
    args = parser.parse_args()
    target = args.target
    if target is None:
        from cuda.bindings import driver as d

        d.cuInit(0)
        target = 1 if int(d.cuDeviceGetCount()[1]) > 1 else 0
    result = anyio.run(measure, args.source, target)
    commit = git_revision()["commit"]
    result["commit"] = commit
    out = Path(args.out)
    stem = f"peer-copy-{args.source}-{target}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Copies from device {result['source']} to {result['target']}",
        "",
        f"commit {commit}; peer access: {result['peer_access']}; {COPIES} copies back to back, "
        f"median of {ROUNDS} rounds, accy and raw alternating",
        "",
        "| bytes | accy GB/s | raw GB/s | accy / raw | accy host µs/copy | raw host µs/copy |",
        "|---|---|---|---|---|---|",
        *(
            f"| {row['bytes']} | {row['accy_gb_s']:.2f} | {row['raw_gb_s']:.2f} | "
            f"{row['accy_gb_s'] / row['raw_gb_s']:.2f} | {row['accy_host_us_per_copy']:.1f} | "
            f"{row['raw_host_us_per_copy']:.1f} |"
            for row in result["rows"]
        ),
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
