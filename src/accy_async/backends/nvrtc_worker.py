"""An NVRTC worker process of :class:`~accy_async.backends.compile_pool.CompilePool`.

Run as ``python -m accy_async.backends.nvrtc_worker``: loads NVRTC, then
answers length-prefixed MessagePack requests ``[source, name, options,
compute_capability]`` on stdin with a reply on stdout, until stdin closes.
Anything else the process prints goes to stderr, so the replies stay intact.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import msgspec

from ..errors import AccyError, CompilationError
from .compile_pool import read_frame, write_frame
from .nvrtc import compile_source, warm_up


def serve(requests: Any, replies: Any) -> None:
    """Answer requests until ``requests`` ends."""
    decoder = msgspec.msgpack.Decoder()
    encoder = msgspec.msgpack.Encoder()
    while (frame := read_frame(requests)) is not None:
        source, name, options, capability = decoder.decode(frame)
        reply: dict[str, Any]
        try:
            image = compile_source(source, name, tuple(options), (capability[0], capability[1]))
            reply = {"ok": True, "image": image.image, "kind": image.kind, "arch": image.arch}
            reply["log"] = image.log
        except AccyError as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": exc.message}
            reply["log"] = exc.log if isinstance(exc, CompilationError) else ""
        except Exception as exc:  # noqa: BLE001 - reported to the parent, not raised here
            reply = {"ok": False, "error": "RuntimeUnavailable", "log": ""}
            reply["message"] = f"NVRTC failed in the worker: {type(exc).__name__}: {exc}"
        write_frame(replies, encoder.encode(reply))


def main() -> None:
    """Keep the reply channel private (fd 1 becomes stderr), load NVRTC, serve."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    warm_up()
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
