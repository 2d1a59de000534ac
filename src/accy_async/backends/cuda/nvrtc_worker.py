"""An NVRTC worker process of :class:`~accy_async.backends.cuda.compile_pool.CompilePool`.

Run as ``python -m accy_async.backends.cuda.nvrtc_worker [MEMORY_BYTES]``: limits
its address space to ``MEMORY_BYTES`` (if given), loads NVRTC, then answers
length-prefixed MessagePack requests ``[source, name, options,
compute_capability, cpu_seconds]`` on stdin with a reply on stdout, until
stdin closes. Each compilation may use ``cpu_seconds`` more CPU time (the
kernel stops the process with ``SIGXCPU`` past it; the pool reports that).
Anything else the process prints goes to stderr, so the replies stay intact.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import msgspec

from ...errors import AccyError, CompilationError
from .compile_pool import read_frame, write_frame
from .nvrtc import compile_source, warm_up


def serve(requests: Any, replies: Any) -> None:
    """Answer requests until ``requests`` ends."""
    decoder = msgspec.msgpack.Decoder()
    encoder = msgspec.msgpack.Encoder()
    while (frame := read_frame(requests)) is not None:
        source, name, options, capability, *rest = decoder.decode(frame)
        if rest and rest[0] is not None:
            _limit_cpu(float(rest[0]))
        reply: dict[str, Any]
        try:
            image = compile_source(source, name, tuple(options), (capability[0], capability[1]))
            reply = {"ok": True, "image": image.image, "kind": image.kind, "arch": image.arch}
            reply["log"] = image.log
            reply["ptx"] = image.ptx
        except AccyError as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": exc.message}
            reply["log"] = exc.log if isinstance(exc, CompilationError) else ""
        except Exception as exc:  # noqa: BLE001 - reported to the parent, not raised here
            reply = {"ok": False, "error": "RuntimeUnavailable", "log": ""}
            reply["message"] = f"NVRTC failed in the worker: {type(exc).__name__}: {exc}"
        write_frame(replies, encoder.encode(reply))


def _limit_cpu(seconds: float) -> None:
    """Let the next compilation use ``seconds`` more CPU time than the process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used + seconds) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def main() -> None:
    """Keep the reply channel private (fd 1 becomes stderr), limit memory, load NVRTC, serve."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    if len(sys.argv) > 1:
        memory = int(sys.argv[1])
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    warm_up()
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
