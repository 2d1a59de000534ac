"""NVRTC in worker processes, so that many kernels compile in parallel.

NVRTC serialises the compilations of one process: on the H200, 32 kernels
took longer from 16 threads than one after another, and 2x less time from
16 processes. :class:`CompilePool` keeps up to ``workers`` worker processes
(``python -m accy_async.backends.cuda.nvrtc_worker``, started on demand, NVRTC
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
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio.to_thread
import msgspec

from ...errors import AccyError, CompilationError, RuntimeUnavailable
from .nvrtc import CompiledImage, cached_image, remember_image

__all__ = [
    "CompileLimits",
    "CompilePool",
    "read_frame",
    "shared_compile_pool",
    "shutdown_compile_pool",
    "write_frame",
]


@dataclass(frozen=True, slots=True)
class CompileLimits:
    """What one compilation in a worker may take; past a limit it fails and the worker is replaced.

    Kernel sources can come from plans made elsewhere; a source that
    instantiates templates without end would otherwise take minutes and
    gigabytes. The defaults are far above what real kernels need.
    """

    cpu_seconds: float = 120.0
    """CPU time of one compilation (``RLIMIT_CPU`` in the worker)."""
    memory_bytes: int = 8 * 2**30
    """The worker's address space (``RLIMIT_AS``)."""
    wall_seconds: float = 300.0
    """Wall-clock time of one compilation: the worker is killed past it."""


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


class _Watchdog:
    """Kills a worker whose compilation runs past its wall-clock or CPU-time limit.

    The CPU time is read from ``/proc`` as well as limited by ``RLIMIT_CPU``
    in the worker: some sandboxes (gVisor) do not enforce the rlimit.
    """

    def __init__(self, process: subprocess.Popen[bytes], limits: CompileLimits) -> None:
        self._process = process
        self._limits = limits
        self._done = threading.Event()
        self.stopped_for: str | None = None
        self._thread = threading.Thread(target=self._watch, name="accy-nvrtc-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        limits = self._limits
        deadline = time.monotonic() + limits.wall_seconds
        start = _cpu_seconds(self._process.pid)
        while not self._done.wait(_WATCH_EVERY):
            if time.monotonic() > deadline:
                self._kill("wall")
                return
            used = _cpu_seconds(self._process.pid)
            if start is not None and used is not None and used - start > limits.cpu_seconds:
                self._kill("cpu")
                return

    def _kill(self, reason: str) -> None:
        self.stopped_for = reason
        self._process.kill()


_WATCH_EVERY: Final = 0.1


def _cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system) process ``pid`` has used, from ``/proc``; else ``None``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class _Worker:
    """One worker process and its pipes; used by one thread at a time."""

    def __init__(self, limits: CompileLimits) -> None:
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            [_PACKAGE_ROOT, *filter(None, [environment.get("PYTHONPATH")])]
        )
        self.limits = limits
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accy_async.backends.cuda.nvrtc_worker",
                str(limits.memory_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=environment,
        )

    def request(self, message: Sequence[Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        watchdog = _Watchdog(self.process, self.limits)
        try:
            write_frame(self.process.stdin, _ENCODER.encode([*message, self.limits.cpu_seconds]))
            reply = read_frame(self.process.stdout)
        except OSError as exc:
            reply = None
            failure: BaseException | None = exc
        else:
            failure = None
        finally:
            watchdog.stop()
        if reply is None:
            raise self._death(watchdog.stopped_for) from failure
        decoded: dict[str, Any] = _DECODER.decode(reply)
        return decoded

    def _death(self, stopped_for: str | None) -> AccyError:
        """Why the worker ended without a reply: a limit (a :class:`CompilationError`), or not."""
        limits = self.limits
        try:
            status = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        if stopped_for == "wall":
            return CompilationError(
                f"the compilation exceeded its wall-clock limit of {limits.wall_seconds:g} s"
            )
        if stopped_for == "cpu" or status == -signal.SIGXCPU:
            return CompilationError(
                f"the compilation exceeded its CPU-time limit of {limits.cpu_seconds:g} s"
            )
        if status is not None and status < 0:
            name = signal.Signals(-status).name
            if -status in (signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV):
                return CompilationError(
                    f"the compiler died ({name}), perhaps past its memory limit of "
                    f"{limits.memory_bytes / 2**30:g} GiB"
                )
            return CompilationError(f"the compiler died ({name})")
        return RuntimeUnavailable(f"the NVRTC worker process exited (status {status})")

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

    def __init__(self, workers: int, limits: CompileLimits | None = None) -> None:
        self.workers = max(1, workers)
        self.limits = limits or CompileLimits()
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
        """Compile like :func:`~accy_async.backends.cuda.nvrtc.compile_source`, in a worker.

        Awaiting never blocks the event loop; a cancelled caller leaves the
        worker to finish and go back to the pool. Raises
        :class:`CompilationError` with NVRTC's log, or naming the limit
        (:class:`CompileLimits`) a compilation went past (its worker is
        replaced), or :class:`RuntimeUnavailable` when a worker cannot run.
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
        image = CompiledImage(
            reply["image"], reply["kind"], reply["arch"], reply["log"], reply.get("ptx", b"")
        )
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
                worker = _Worker(self.limits)
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
        if self._closed or worker.process.poll() is not None:
            # Closing, or the worker died after its reply (its watchdog fired just then).
            with self._lock:
                if worker in self._all:
                    self._all.remove(worker)
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
