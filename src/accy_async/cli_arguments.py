"""What the command-line modules share: argument types, the backend choice, plan references."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final

from .errors import AccyError

__all__ = ["BACKENDS", "BACKEND_HELP", "existing_file", "positive_float", "positive_int"]

BACKENDS: Final = ("auto", "cuda", "cpu")
BACKEND_HELP: Final = "auto (the GPU if there is one, else the CPU), cuda or cpu"


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
