"""An async service over PyTorch tensors: each request's tensor is scanned where it lies.

Every client task makes its tensor on its own PyTorch stream (as a model's output
would be), hands it to ``await scan(x, stream=stream)`` and gets a tensor back, without
a copy and without a host synchronisation: the scan runs on the client's stream, after
the work that made ``x``. (PyTorch's "current stream" is one per thread, shared by every
task of the loop, so async code names its streams instead of relying on it.) The
client then awaits that stream with ``accy.wait_stream`` (never
``torch.cuda.synchronize()``, which would stop every other client) and checks the
result against ``torch.cumsum``. A heartbeat task on the same loop reports how late it
ever ran: nothing here blocks the event loop.

On the CPU backend the tensors are CPU tensors, taken in place through DLPack; the
results come back as NumPy arrays, which ``torch.from_numpy`` wraps without a copy.

    python examples/torch_service.py                    # the GPU if there is one
    python examples/torch_service.py --backend cpu --clients 8 --requests 20
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Literal

import anyio

import accy_async as accy


async def client(
    scan: accy.PipelineCall,
    backend: accy.Backend,
    torch: Any,
    seed: int,
    requests: int,
    wrong: list[int],
) -> None:
    """``requests`` scans of int32 tensors of varied length, each checked."""
    sizes = torch.Generator().manual_seed(seed)
    on_gpu = backend.kind == "cuda"
    device = "cuda" if on_gpu else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    stream = torch.cuda.Stream() if on_gpu else None
    for _ in range(requests):
        n = int(torch.randint(1, 200_000, (1,), generator=sizes))
        if on_gpu:
            # PyTorch's current stream belongs to the thread, which every task shares: set
            # it only around code with no await inside, and name the stream to the call.
            with torch.cuda.stream(stream):  # made on this client's stream, on the device
                x = torch.randint(
                    -1000, 1000, (n,), generator=generator, dtype=torch.int32, device=device
                )
            y = await scan(x, stream=stream)  # runs there too: a tensor back, nothing copied
            with torch.cuda.stream(stream):
                same = (y == torch.cumsum(x, 0, dtype=torch.int32)).all()  # queued, not read
            await accy.wait_stream(backend, stream)  # the loop stays free meanwhile
            with torch.cuda.stream(stream):
                right = bool(same)  # the stream is idle: reading it waits for nothing
        else:
            x = torch.randint(-1000, 1000, (n,), generator=generator, dtype=torch.int32)
            y = torch.from_numpy(await scan(x))  # the tensor's memory, used in place
            right = torch.equal(y, torch.cumsum(x, 0, dtype=torch.int32))
        if not right:
            wrong[0] += 1


async def heartbeat(lag: list[float], period: float = 0.001) -> None:
    """Tick every millisecond; remember the worst lateness."""
    while True:
        due = time.perf_counter() + period
        await anyio.sleep(period)
        lag[0] = max(lag[0], time.perf_counter() - due)


async def serve(backend_name: Literal["auto", "cuda", "cpu"], clients: int, requests: int) -> int:
    try:
        import torch
    except ImportError:
        print("torch_service needs PyTorch (pip install torch)", file=sys.stderr)
        return 2
    wrong = [0]
    lag = [0.0]
    async with accy.open_backend(backend_name) as backend:
        if backend.kind == "cuda" and not torch.cuda.is_available():
            print("PyTorch has no CUDA here; use --backend cpu", file=sys.stderr)
            return 2
        async with (
            accy.open_pipeline("prefix_sum_i32", backend=backend) as scan,
            anyio.create_task_group() as clients_group,
        ):
            # Warm up before taking traffic, as a service does: PyTorch loads its kernels on
            # first use, and that blocks the thread (for ~100 ms on the H200).
            await client(scan, backend, torch, clients, 1, wrong)
            started = time.perf_counter()
            clients_group.start_soon(heartbeat, lag)
            async with anyio.create_task_group() as requests_group:
                for seed in range(clients):
                    requests_group.start_soon(client, scan, backend, torch, seed, requests, wrong)
            clients_group.cancel_scope.cancel()
        elapsed = time.perf_counter() - started
        total = clients * requests
        print(
            f"{total} scans of PyTorch tensors on {backend.name} from {clients} tasks in "
            f"{elapsed:.2f} s ({total / elapsed:,.0f}/s), {wrong[0]} wrong; "
            f"worst heartbeat lag {lag[0] * 1e3:.1f} ms"
        )
    return 1 if wrong[0] else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--clients", type=int, default=32, help="concurrent client tasks")
    parser.add_argument("--requests", type=int, default=50, help="scans per client")
    arguments = parser.parse_args()
    if arguments.clients < 1 or arguments.requests < 1:
        parser.error("--clients and --requests must be at least 1")
    try:
        return anyio.run(serve, arguments.backend, arguments.clients, arguments.requests)
    except accy.AccyError as error:
        print(f"torch_service: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
