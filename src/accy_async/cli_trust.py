"""The command line's trust in plans: which CUDA kernels ``run`` and ``tune`` may compile.

A plan file from elsewhere carries its CUDA kernels as code. The commands
compile only the library's own kernels and those whose digests are in the
user's trust file (``--trust-file``, else ``$ACCY_TRUST_FILE``, else
``~/.config/accy-async/trusted-kernels``), unless ``--trust`` says the
plan's source is trusted. ``accy-async digests PLAN``
prints the digests to put in a trust file. See ``docs/security.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import AccyError, UntrustedKernel
from .trust import TrustPolicy, document_digests, read_trust_file

__all__ = [
    "DEFAULT_TRUST_FILE",
    "add_digests_parser",
    "add_trust_arguments",
    "digests",
    "explain_untrusted",
    "trust_policy_from",
    "untrusted_explained",
]

DEFAULT_TRUST_FILE = Path("~/.config/accy-async/trusted-kernels")


def add_trust_arguments(parser: argparse.ArgumentParser) -> None:
    """``--trust`` and ``--trust-file`` for a command that compiles a plan's kernels."""
    parser.add_argument(
        "--trust",
        action="store_true",
        help="compile the plan's CUDA kernels whatever they are (only for plans you trust)",
    )
    parser.add_argument(
        "--trust-file",
        metavar="PATH",
        help="digests of CUDA kernels to trust besides the built-in ones (default: "
        "$ACCY_TRUST_FILE, else ~/.config/accy-async/trusted-kernels if it exists)",
    )


def trust_policy_from(args: argparse.Namespace) -> TrustPolicy | None:
    """The policy the command's backend gets: ``None`` with ``--trust``.

    Raises :class:`AccyError` for a trust file that cannot be read or holds
    something that is not a digest.
    """
    if getattr(args, "trust", False):
        return None
    path = _trust_file(getattr(args, "trust_file", None))
    if path is None:
        return TrustPolicy.builtin()
    try:
        return TrustPolicy.builtin(read_trust_file(path))
    except OSError as exc:
        raise AccyError(f"cannot read the trust file {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise AccyError(f"trust file: {exc}") from exc


def _trust_file(given: str | None) -> Path | None:
    if given is not None:
        return Path(given)
    from_environment = os.environ.get("ACCY_TRUST_FILE")
    if from_environment:
        return Path(from_environment)
    default = DEFAULT_TRUST_FILE.expanduser()
    return default if default.is_file() else None


def explain_untrusted(error: UntrustedKernel, plan: str) -> AccyError:
    """The refusal as the command line says it: what to do about it."""
    return UntrustedKernel(
        f"{plan}: {error.message}. Run with --trust if you trust where the plan came from, "
        f"or add its digests (accy-async digests {plan}) to your trust file",
        path=error.path,
    )


@contextlib.contextmanager
def untrusted_explained(plan: str) -> Iterator[None]:
    """Turn an :class:`UntrustedKernel` raised inside (task groups' too) into the explained one."""
    try:
        yield
    except BaseException as error:
        untrusted = _untrusted_in(error)
        if untrusted is None:
            raise
        raise explain_untrusted(untrusted, plan) from None


def _untrusted_in(error: BaseException) -> UntrustedKernel | None:
    """``error`` if it is the refusal, else the first refusal in an exception group."""
    if isinstance(error, UntrustedKernel):
        return error
    if isinstance(error, BaseExceptionGroup):
        for each in error.exceptions:
            found = _untrusted_in(each)
            if found is not None:
                return found
    return None


def add_digests_parser(commands: Any) -> None:
    """The ``digests`` command."""
    command = commands.add_parser(
        "digests", help="print the digests of a plan's CUDA kernels, for a trust file"
    )
    command.add_argument("plans", nargs="+", help="plan files or built-in plan names")


def digests(args: argparse.Namespace, load: Any) -> int:
    """Print ``digest  plan  path  what`` for each CUDA kernel each plan can compile."""
    for reference in args.plans:
        for digest, path, what in document_digests(load(reference)):
            print(f"{digest}  {reference}  {path}  {what}")
    return 0
