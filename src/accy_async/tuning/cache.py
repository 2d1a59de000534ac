"""The persistent tuning cache: one msgspec-encoded file, safe to share between processes.

Results are keyed by :func:`tuning_key`: the device (name and UUID), the
driver and compiler versions, the problem itself (kernel source, entry,
compile options, candidates, buffers) and its runtime scalars. Writers take an
exclusive ``flock`` on ``PATH.lock``, merge their entries into what is on
disk, write a temporary file and ``os.replace`` it over ``PATH``: readers
never see a half-written file and two processes writing at once both keep
their entries. A cache file that cannot be decoded is set aside as
``PATH.corrupt`` with a warning and the cache starts empty.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Final

import anyio.to_thread
import msgspec

from ..backends import DeviceIdentity
from ..plan import KernelTuningProblem, PipelineTuningProblem
from ..plan._base import Base
from .results import TuningResult

__all__ = ["CACHE_FORMAT_VERSION", "TuningCache", "tuning_key"]

CACHE_FORMAT_VERSION: Final = 1


class _CacheFile(Base, frozen=True):
    version: int
    entries: dict[str, TuningResult]


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(_CacheFile)


def tuning_key(
    identity: DeviceIdentity,
    problem: KernelTuningProblem | PipelineTuningProblem,
    *,
    flush_cache: bool,
) -> str:
    """The cache key of ``problem`` on the device ``identity`` (a SHA-256 hex digest).

    The problem's name is left out, so equal problems under two names share
    one result (and one run).
    """
    body = msgspec.structs.replace(problem, name="_")
    material = _ENCODER.encode((CACHE_FORMAT_VERSION, identity, body, flush_cache))
    return hashlib.sha256(material).hexdigest()


class TuningCache:
    """Tuning results persisted in the file ``path``; see the module docstring.

    ``get`` and ``put`` do file I/O; from async code use ``aget``/``aput``,
    which run it in a worker thread.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._memory: dict[str, TuningResult] = {}
        self._stamp: tuple[int, int] | None = None

    def get(self, key: str) -> TuningResult | None:
        """The result stored under ``key``, or ``None``."""
        self._refresh()
        return self._memory.get(key)

    def put(self, key: str, result: TuningResult) -> None:
        """Store ``result`` under ``key``, keeping every other process's entries."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                entries = dict(self._read())
                entries[key] = result
                self._write(entries)
                self._memory = entries
                self._stamp = self._file_stamp()
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def entries(self) -> dict[str, TuningResult]:
        """Every stored result by key."""
        self._refresh()
        return dict(self._memory)

    async def aget(self, key: str) -> TuningResult | None:
        """:meth:`get` in a worker thread."""
        return await anyio.to_thread.run_sync(self.get, key)

    async def aput(self, key: str, result: TuningResult) -> None:
        """:meth:`put` in a worker thread."""
        await anyio.to_thread.run_sync(self.put, key, result)

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            status = self.path.stat()
        except FileNotFoundError:
            return None
        return status.st_mtime_ns, status.st_ino

    def _refresh(self) -> None:
        stamp = self._file_stamp()
        if stamp != self._stamp:
            self._memory = self._read()
            self._stamp = stamp

    def _read(self) -> dict[str, TuningResult]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            decoded = _DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            corrupt = self.path.with_name(self.path.name + ".corrupt")
            warnings.warn(
                f"accy-async: the tuning cache {self.path} cannot be read ({exc}); "
                f"moved it to {corrupt} and starting empty",
                RuntimeWarning,
                stacklevel=3,
            )
            # Another process may have moved it first (two runs recovering at once).
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path, corrupt)
            return {}
        if decoded.version != CACHE_FORMAT_VERSION:
            return {}
        return decoded.entries

    def _write(self, entries: dict[str, TuningResult]) -> None:
        data = _ENCODER.encode(_CacheFile(version=CACHE_FORMAT_VERSION, entries=entries))
        descriptor, temporary = tempfile.mkstemp(
            prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent
        )
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
