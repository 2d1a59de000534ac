"""NVRTC in worker processes, so that many kernels compile in parallel.

NVRTC serialises the compilations of one process: on the H200, 32 kernels
took longer from 16 threads than one after another, and 2x less time from
16 processes. :class:`CompilePool` keeps up to ``workers`` worker processes
(``python -m accy_async.backends.nvrtc_worker``, started on demand, NVRTC
loaded before their first request) and hands each compilation to an idle one
over a pipe. Plain subprocesses rather than :mod:`multiprocessing`: nothing
re-imports the caller's ``__main__``, nothing is forked from a process that
holds a CUDA context. Use :func:`shared_compile_pool`: workers are started
once per process and kept for the next compilation.
"""

from __future__ import annotations

import atexit
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import anyio.to_thread
import msgspec

from ..errors import CompilationError, RuntimeUnavailable
from .nvrtc import CompiledImage, cached_image, remember_image

__all__ = ["CompilePool", "shared_compile_pool", "shutdown_compile_pool"]

_HEADER: Final = 4
_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder()
_PACKAGE_ROOT: Final = str(Path(__file__).resolve().parents[2])


def write_frame(stream: Any, payload: bytes) -> None:
    """Write one length-prefixed frame and flush."""
    stream.write(len(payload).to_bytes(_HEADER, "little") + payload)
    stream.flush()


def read_frame(stream: Any) -> bytes | None:
    """Read one length-prefixed frame; ``None`` at the end of the stream."""
    header = stream.read(_HEADER)
    if len(header) < _HEADER:
        return None
    size = int.from_bytes(header, "little")
    payload: bytes = stream.read(size)
    return payload if len(payload) == size else None


class _Worker:
    """One worker process and its pipes; used by one thread at a time."""

    def __init__(self) -> None:
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            [_PACKAGE_ROOT, *filter(None, [environment.get("PYTHONPATH")])]
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "accy_async.backends.nvrtc_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=environment,
        )

    def request(self, message: Sequence[Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        try:
            write_frame(self.process.stdin, _ENCODER.encode(message))
            reply = read_frame(self.process.stdout)
        except OSError as exc:
            raise RuntimeUnavailable(f"the NVRTC worker process failed: {exc}") from exc
        if reply is None:
            raise RuntimeUnavailable(
                f"the NVRTC worker process exited (status {self.process.poll()})"
            )
        decoded: dict[str, Any] = _DECODER.decode(reply)
        return decoded

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


class CompilePool:
    """Up to ``workers`` NVRTC worker processes; see the module docstring."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    async def compile(
        self,
        source: str,
        name: str,
        options: Sequence[str],
        compute_capability: tuple[int, int],
    ) -> CompiledImage:
        """Compile like :func:`~accy_async.backends.nvrtc.compile_source`, in a worker.

        Awaiting never blocks the event loop; a cancelled caller leaves the
        worker to finish and go back to the pool. Raises
        :class:`CompilationError` with NVRTC's log, or
        :class:`RuntimeUnavailable` when a worker cannot run.
        """
        cached = cached_image(source, name, options, compute_capability)
        if cached is not None:
            return cached
        message = (source, name, list(options), list(compute_capability))
        reply = await anyio.to_thread.run_sync(self._request, message, abandon_on_cancel=True)
        if not reply["ok"]:
            if reply["error"] == "CompilationError":
                raise CompilationError(reply["message"], log=reply["log"])
            raise RuntimeUnavailable(reply["message"])
        image = CompiledImage(reply["image"], reply["kind"], reply["arch"], reply["log"])
        remember_image(source, name, options, compute_capability, image)
        return image

    def _take(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._closed:
                raise RuntimeUnavailable("the compile pool is shut down")
            if len(self._all) < self.workers:
                worker = _Worker()
                self._all.append(worker)
                return worker
        return self._idle.get()

    def _request(self, message: Sequence[Any]) -> dict[str, Any]:
        worker = self._take()
        try:
            reply = worker.request(message)
        except BaseException:
            with self._lock:
                self._all.remove(worker)
            worker.close()
            raise
        if self._closed:
            worker.close()
        else:
            self._idle.put(worker)
        return reply

    def close(self) -> None:
        """Stop the idle workers; busy ones stop after their compilation."""
        with self._lock:
            self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


_shared_pool: CompilePool | None = None
_shared_pool_lock = threading.Lock()


def shared_compile_pool(workers: int) -> CompilePool:
    """The process's compile pool with at least ``workers`` workers, kept between uses.

    It lives until :func:`shutdown_compile_pool` or the interpreter's exit.
    """
    global _shared_pool
    with _shared_pool_lock:
        pool = _shared_pool
        if pool is None:
            pool = _shared_pool = CompilePool(workers)
        else:
            pool.workers = max(pool.workers, workers)
        return pool


def shutdown_compile_pool() -> None:
    """Stop the shared compile pool's workers, if it was started."""
    global _shared_pool
    with _shared_pool_lock:
        pool, _shared_pool = _shared_pool, None
    if pool is not None:
        pool.close()


atexit.register(shutdown_compile_pool)
