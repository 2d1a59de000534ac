"""Compiling CUDA C++ with NVRTC: a cubin for the device's own architecture, PTX as fallback.

A cubin built for the exact device runs as is. PTX is JIT-compiled by the
driver at load, and the driver refuses PTX from an NVRTC newer than itself,
so PTX is only the fallback for a device newer than NVRTC knows (compiled for
the newest architecture NVRTC supports). Results are cached in-process by
source, options and architecture. Compiling takes CPU time: the backend runs
it in a worker thread, never on the event loop's thread.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from ...errors import CompilationError, RuntimeUnavailable

__all__ = [
    "CompiledImage",
    "cached_image",
    "compile_source",
    "nvrtc_version",
    "remember_image",
    "warm_up",
]

_CACHE_CAPACITY: Final = 256
_cache: OrderedDict[str, CompiledImage] = OrderedDict()
_cache_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class CompiledImage:
    """What NVRTC produced: ``kind`` is ``"cubin"`` or ``"ptx"``; ``log`` its messages.

    ``ptx`` is the PTX the image was made from (the image itself for ``"ptx"``;
    empty where NVRTC did not give it): a kernel's argument-table variant is
    made from it (see :mod:`._table_ptx`).
    """

    image: bytes
    kind: str
    arch: str
    log: str
    ptx: bytes = b""


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
        raise RuntimeUnavailable(f"cuda-python's NVRTC bindings are missing: {exc}") from exc
    return nvrtc


def _check(result: Any, action: str, log: str = "") -> None:
    code = result[0] if isinstance(result, tuple) else result
    if int(code):
        nvrtc = _nvrtc()
        _, text = nvrtc.nvrtcGetErrorString(code)
        raise CompilationError(f"NVRTC {action} failed: {text.decode()}", log=log)


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's ``(major, minor)``; :class:`RuntimeUnavailable` when the library is missing."""
    nvrtc = _nvrtc()
    try:
        result, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:
        raise RuntimeUnavailable(f"NVRTC cannot be loaded: {exc}") from exc
    _check((result,), "version")
    return int(major), int(minor)


def _supported_architectures() -> list[int]:
    nvrtc = _nvrtc()
    result, archs = nvrtc.nvrtcGetSupportedArchs()
    _check((result,), "listing architectures")
    return sorted(int(a) for a in archs)


def compile_source(
    source: str, name: str, options: Sequence[str], compute_capability: tuple[int, int]
) -> CompiledImage:
    """Compile ``source`` for a device of ``compute_capability``.

    Raises :class:`CompilationError` with NVRTC's log when the source does not
    compile.
    """
    key = _cache_key(source, name, options, compute_capability)
    cached = _lookup(key)
    if cached is not None:
        return cached
    device_arch = compute_capability[0] * 10 + compute_capability[1]
    try:
        supported = _supported_architectures()
    except (CompilationError, RuntimeUnavailable):
        raise
    except Exception as exc:  # cuda-bindings raises its own error when libnvrtc is missing
        raise RuntimeUnavailable(f"NVRTC cannot be loaded: {exc}") from exc
    if device_arch in supported:
        image = _compile(source, name, options, f"-arch=sm_{device_arch}", "cubin")
    else:
        usable = [arch for arch in supported if arch <= device_arch] or supported[-1:]
        image = _compile(source, name, options, f"-arch=compute_{usable[-1]}", "ptx")
    _store(key, image)
    return image


def cached_image(
    source: str, name: str, options: Sequence[str], compute_capability: tuple[int, int]
) -> CompiledImage | None:
    """The image compiled earlier in this process for these arguments, if any."""
    return _lookup(_cache_key(source, name, options, compute_capability))


def remember_image(
    source: str,
    name: str,
    options: Sequence[str],
    compute_capability: tuple[int, int],
    image: CompiledImage,
) -> None:
    """Keep an image compiled elsewhere (a worker process) in this process's cache."""
    _store(_cache_key(source, name, options, compute_capability), image)


def _lookup(key: str) -> CompiledImage | None:
    with _cache_lock:
        cached = _cache.get(key)
        if cached is not None:
            _cache.move_to_end(key)
        return cached


def _store(key: str, image: CompiledImage) -> None:
    with _cache_lock:
        _cache[key] = image
        if len(_cache) > _CACHE_CAPACITY:
            _cache.popitem(last=False)


def warm_up() -> None:
    """Load NVRTC and its builtins by compiling an empty kernel; quietly skip without NVRTC."""
    try:
        arch = _supported_architectures()[0]
        _compile(
            'extern "C" __global__ void accy_warm() {}',
            "accy_warm",
            (),
            f"-arch=compute_{arch}",
            "ptx",
        )
    except Exception:  # noqa: BLE001 - a worker without NVRTC reports it at its first compile
        return


def _cache_key(
    source: str, name: str, options: Sequence[str], compute_capability: tuple[int, int]
) -> str:
    return hashlib.sha256(
        "\0".join([source, name, *options, repr(compute_capability)]).encode()
    ).hexdigest()


def _compile(
    source: str, name: str, options: Sequence[str], arch_option: str, kind: str
) -> CompiledImage:
    nvrtc = _nvrtc()
    result, program = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check((result,), "creating a program")
    try:
        flags = [arch_option.encode(), b"-std=c++17", *(option.encode() for option in options)]
        (result,) = nvrtc.nvrtcCompileProgram(program, len(flags), flags)
        log = _log(program)
        _check((result,), f"compiling {name}", log)
        if kind == "cubin":
            result, size = nvrtc.nvrtcGetCUBINSize(program)
            _check((result,), "sizing the cubin", log)
            image = b" " * size
            _check(nvrtc.nvrtcGetCUBIN(program, image), "reading the cubin", log)
            ptx = _ptx(program)
        else:
            result, size = nvrtc.nvrtcGetPTXSize(program)
            _check((result,), "sizing the PTX", log)
            image = ptx = b" " * size
            _check(nvrtc.nvrtcGetPTX(program, image), "reading the PTX", log)
        return CompiledImage(image, kind, arch_option.split("=", 1)[1], log, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _ptx(program: Any) -> bytes:
    """The PTX NVRTC keeps beside a cubin, or nothing (the cubin serves without it)."""
    nvrtc = _nvrtc()
    result, size = nvrtc.nvrtcGetPTXSize(program)
    if int(result) or size <= 1:
        return b""
    text = b" " * size
    (result,) = nvrtc.nvrtcGetPTX(program, text)
    return b"" if int(result) else text


def _log(program: Any) -> str:
    nvrtc = _nvrtc()
    result, size = nvrtc.nvrtcGetProgramLogSize(program)
    if int(result) or size <= 1:
        return ""
    text = b" " * size
    nvrtc.nvrtcGetProgramLog(program, text)
    decoded: str = text.rstrip(b"\0").decode(errors="replace").strip()
    return decoded
