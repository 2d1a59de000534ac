"""What the command-line modules share: argument types, the backend choice, plans, progress."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Final, TextIO

from . import library
from .errors import AccyError
from .plan import PlanDocument, decode_json, decode_msgpack

__all__ = [
    "BACKENDS",
    "BACKEND_HELP",
    "Progress",
    "backend_kind",
    "existing_file",
    "load_document",
    "positive_float",
    "positive_int",
]

BACKENDS: Final = ("auto", "cuda", "cpu")
BACKEND_HELP: Final = (
    "auto (the GPU if there is one, else the CPU), cuda, cuda:N (the GPU of ordinal N) or cpu"
)

_MSGPACK_SUFFIXES: Final = (".msgpack", ".mpk", ".msgpk")
"""Plan files with these suffixes are read as MessagePack; any other file as JSON."""


class Progress:
    """Steps of long work on stderr, each with its elapsed time."""

    def __init__(self, stream: TextIO, *, quiet: bool = False) -> None:
        self.stream = stream
        self.quiet = quiet
        self.start = time.perf_counter()

    def step(self, message: str) -> None:
        """Print ``message`` with the time since the start (unless quiet)."""
        if not self.quiet:
            elapsed = time.perf_counter() - self.start
            print(f"[{elapsed:7.3f} s] {message}", file=self.stream, flush=True)


def backend_kind(text: str) -> str:
    """An argparse type: one of :data:`BACKENDS`, or ``cuda:N``."""
    ordinal = text.removeprefix("cuda:")
    if text in BACKENDS or (text.startswith("cuda:") and ordinal.isascii() and ordinal.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not auto, cuda, cuda:N or cpu")


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def existing_file(reference: str, what: str) -> Path | None:
    """``reference`` as a file path if there is such a file; ``None`` if nothing is there.

    Raises :class:`AccyError` for a folder ("give a ``what``").
    """
    path = Path(reference)
    if path.is_dir():
        raise AccyError(f"{reference} is a folder; give a {what}")
    return path if path.exists() else None


def load_document(reference: str) -> PlanDocument:
    """A plan from a file path (JSON, or MessagePack by suffix), or a built-in plan by name."""
    path = existing_file(reference, "plan file")
    if path is not None:
        data = path.read_bytes()
        if path.suffix.lower() in _MSGPACK_SUFFIXES:
            packed: PlanDocument = decode_msgpack(data, PlanDocument)
            return packed
        document: PlanDocument = decode_json(data, PlanDocument)
        return document
    if reference in library.BUILTIN_PLANS:
        return library.load_builtin(reference)
    raise AccyError(
        f"{reference!r} is neither a file nor a built-in plan ({', '.join(library.BUILTIN_PLANS)})"
    )
