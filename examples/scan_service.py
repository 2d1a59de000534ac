"""An async TCP service that answers prefix-sum requests with `await launch_pipeline`.

Protocol: a JSON header line, then raw bytes. ``{"scan": N}`` followed by N little-endian
int32 values is answered with ``{"result": N}`` and the N int32 of the inclusive prefix
sum (or ``{"error": "..."}``); ``{"ping": 1}`` is answered with ``{"pong": 1}`` at once,
even while scans are running, because nothing in the service blocks the event loop.

    python examples/scan_service.py --port 8765            # serve
    python examples/scan_service.py --self-test            # serve, hit it, check, exit
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio
import anyio.abc
import numpy as np
from anyio.streams.buffered import BufferedByteReceiveStream

import accy_async as accy

MAX_ELEMENTS = 10_000_000


class ScanService:
    """Shares one pool of loaded kernels between every connection."""

    def __init__(
        self,
        backend: accy.Backend,
        pool: accy.PipelineArtifactPool,
        document: accy.plan.PipelineDocument,
        lanes: int = 4,
    ) -> None:
        self.backend = backend
        self.pool = pool
        self.document = document
        self.lanes = [backend.create_stream() for _ in range(lanes)]
        self.served = 0

    async def scan(self, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        backend, document = self.backend, self.document
        n = array.size
        scalars = (accy.U32(n),)
        stream = self.lanes[self.served % len(self.lanes)]
        self.served += 1
        source = accy.upload(backend, array, stream=stream)
        result = backend.allocate_buffer(4 * n)
        try:
            async with await accy.allocate_pipeline_intermediates(
                backend, document.pipeline, scalars
            ) as scratch:
                await accy.launch_pipeline(
                    backend,
                    accy.PipelineLaunch(
                        pipeline=document.pipeline,
                        registry=document.registry,
                        format=self.pool.format,
                        operands=[source.bind("read_only")],
                        results=[result.bind()],
                        runtime_scalar_arguments=scalars,
                        intermediates=scratch,
                        artifacts=self.pool,
                        stream=stream,
                    ),
                )
                out = await accy.download(backend, result, np.int32, n, stream=stream)
        finally:
            backend.destroy_all([source, result])
        return out

    async def handle(self, client: anyio.abc.ByteStream) -> None:
        reader = BufferedByteReceiveStream(client)
        async with client:
            while True:
                try:
                    line = await reader.receive_until(b"\n", 64 * MAX_ELEMENTS)
                except (anyio.IncompleteRead, anyio.EndOfStream):
                    return
                header: dict[str, Any] = json.loads(line)
                if "ping" in header:
                    await client.send(json.dumps({"pong": header["ping"]}).encode() + b"\n")
                    continue
                n = int(header.get("scan", 0))
                if not 0 < n <= MAX_ELEMENTS:
                    error = f"send between 1 and {MAX_ELEMENTS} values"
                    await client.send(json.dumps({"error": error}).encode() + b"\n")
                    continue
                body = await reader.receive_exactly(4 * n)
                try:
                    result = await self.scan(np.frombuffer(body, dtype="<i4"))
                except accy.AccyError as exc:
                    await client.send(json.dumps({"error": str(exc)}).encode() + b"\n")
                    continue
                await client.send(json.dumps({"result": n}).encode() + b"\n" + result.tobytes())


async def serve(
    port: int,
    backend_kind: accy.backends.BackendKind,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    document = accy.library.load_builtin("prefix_sum_i32")
    async with accy.open_backend(backend_kind) as backend:
        fmt = backend.preferred_formats[0]
        async with await accy.load_pipeline_artifacts(
            backend, document.pipeline, document.registry, fmt
        ) as pool:
            service = ScanService(backend, pool, document)
            try:
                listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
                bound = listener.extra(anyio.abc.SocketAttribute.local_port)
                task_status.started(bound)
                await listener.serve(service.handle)
            finally:
                with anyio.CancelScope(shield=True):
                    await accy.synchronize(backend)
                backend.destroy_all(service.lanes)


async def request(
    port: int, header: dict[str, Any], body: bytes = b""
) -> tuple[dict[str, Any], bytes]:
    """Send one request; return the reply's header and body."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(json.dumps(header).encode() + b"\n" + body)
        reader = BufferedByteReceiveStream(stream)
        reply: dict[str, Any] = json.loads(await reader.receive_until(b"\n", 4096))
        data = await reader.receive_exactly(4 * reply["result"]) if "result" in reply else b""
        return reply, data


async def self_test(backend_kind: accy.backends.BackendKind, clients: int) -> int:
    wrong = 0
    worst_ping = 0.0
    async with anyio.create_task_group() as group:
        port = await group.start(serve, 0, backend_kind)

        async def scanner(client: int) -> None:
            nonlocal wrong
            values = np.arange(client, client + 1 + client * 997 % 200_000, dtype="<i4")
            reply, data = await request(port, {"scan": values.size}, values.tobytes())
            expected = np.cumsum(values, dtype=np.int32)
            if reply != {"result": values.size} or not np.array_equal(
                np.frombuffer(data, dtype="<i4"), expected
            ):
                wrong += 1

        async def pinger() -> None:
            nonlocal worst_ping
            for _ in range(20):
                start = time.perf_counter()
                assert (await request(port, {"ping": 1}))[0] == {"pong": 1}
                worst_ping = max(worst_ping, time.perf_counter() - start)

        async with anyio.create_task_group() as clients_group:
            clients_group.start_soon(pinger)
            for client in range(clients):
                clients_group.start_soon(scanner, client)
        bad, _ = await request(port, {"scan": 0})
        group.cancel_scope.cancel()
    print(
        f"{clients} scan clients: {clients - wrong} correct; worst ping {worst_ping * 1e3:.1f} "
        f"ms while scanning; empty request answered {bad}"
    )
    return 1 if wrong or "error" not in bad else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--self-test", action="store_true")
    parser.add_argument("--clients", type=int, default=50)
    args = parser.parse_args()
    if args.self_test:
        raise SystemExit(anyio.run(self_test, args.backend, args.clients))
    anyio.run(serve, args.port, args.backend)
