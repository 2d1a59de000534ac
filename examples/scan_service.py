"""An async TCP service that answers prefix-sum requests with `await launch_pipeline`.

Protocol: a JSON header line, then raw bytes. ``{"scan": N}`` followed by N little-endian
int32 values is answered with ``{"result": N}`` and the N int32 of the inclusive prefix
sum (or ``{"error": "..."}``); ``{"ping": 1}`` is answered with ``{"pong": 1}`` at once,
even while scans are running, because nothing in the service blocks the event loop. A bad
request (not JSON, not an object, a count that is not a whole number in range) gets an
error reply and the connection goes on; a body cut short ends that connection only.

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
MAX_HEADER = 4096


class BadRequest(Exception):
    """A request the service answers with ``{"error": ...}``."""


def parse_header(line: bytes) -> dict[str, Any]:
    """The request's header: a JSON object (raises :class:`BadRequest` otherwise)."""
    try:
        header = json.loads(line)
    except ValueError:
        raise BadRequest("the header is not JSON") from None
    if not isinstance(header, dict):
        raise BadRequest("the header must be a JSON object")
    return header


def scan_count(header: dict[str, Any]) -> int:
    """The number of values a scan request announces (raises :class:`BadRequest`)."""
    n = header.get("scan")
    if type(n) is not int or not 0 < n <= MAX_ELEMENTS:
        raise BadRequest(f"'scan' must be a whole number from 1 to {MAX_ELEMENTS}")
    return n


def frame(header: Any, body: bytes = b"") -> bytes:
    """A message: the JSON header line, then the body."""
    return json.dumps(header).encode() + b"\n" + body


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
        """Answer one connection's requests until it closes; a bad request gets an error."""
        reader = BufferedByteReceiveStream(client)
        async with client:
            while True:
                try:
                    line = await reader.receive_until(b"\n", MAX_HEADER)
                except (anyio.IncompleteRead, anyio.EndOfStream):
                    return
                except anyio.DelimiterNotFound:
                    await client.send(frame({"error": f"headers end within {MAX_HEADER} bytes"}))
                    return
                try:
                    answer = await self.answer(parse_header(line), reader)
                except BadRequest as exc:
                    answer = frame({"error": str(exc)})
                except (anyio.IncompleteRead, anyio.EndOfStream):
                    return  # the body was cut short: nothing more can be read on this one
                await client.send(answer)

    async def answer(self, header: dict[str, Any], reader: BufferedByteReceiveStream) -> bytes:
        """The reply to one request whose header was read."""
        if "ping" in header:
            return frame({"pong": header["ping"]})
        n = scan_count(header)
        body = await reader.receive_exactly(4 * n)
        try:
            result = await self.scan(np.frombuffer(body, dtype="<i4"))
        except accy.AccyError as exc:
            raise BadRequest(str(exc)) from None
        return frame({"result": n}, result.tobytes())


async def serve(
    port: int,
    backend_kind: accy.backends.BackendKind,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    document = accy.library.load_builtin("prefix_sum_i32")
    async with (
        accy.open_backend(backend_kind) as backend,
        await accy.load_pipeline_artifacts(backend, document.pipeline, document.registry) as pool,
    ):
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
    port: int, header: Any, body: bytes = b"", *, raw: bytes | None = None
) -> tuple[dict[str, Any], bytes]:
    """Send one request (or ``raw`` bytes); return the reply's header and body."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(raw if raw is not None else frame(header, body))
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
        bad = [
            (await request(port, None, raw=raw))[0]
            for raw in (b'{"scan": 0}\n', b"not json\n", b"[1, 2]\n", b'{"scan": "abc"}\n')
        ]
        await cut_short(port)
        still = await request(port, {"scan": 3}, np.ones(3, "<i4").tobytes())
        group.cancel_scope.cancel()
    answered = all("error" in each for each in bad) and still[0] == {"result": 3}
    print(
        f"{clients} scan clients: {clients - wrong} correct; worst ping {worst_ping * 1e3:.1f} "
        f"ms while scanning; {len(bad)} bad requests and a cut body "
        f"{'answered, still serving' if answered else 'NOT handled'}"
    )
    return 1 if wrong or not answered else 0


async def cut_short(port: int) -> None:
    """A scan whose body ends early: the service drops that connection, nothing else."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(frame({"scan": 100}, b"\0" * 10))
        await stream.send_eof()
        with anyio.fail_after(10):
            while True:
                try:
                    await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return


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
