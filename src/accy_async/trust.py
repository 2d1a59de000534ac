"""Which kernels may run: CUDA payloads are code, so an application says which it trusts.

A plan names CPU kernels (registered by the application; decoding a plan runs
nothing) but carries CUDA kernels as source, PTX or a cubin, and a kernel can
read and write every buffer of the process's CUDA context. A
:class:`TrustPolicy` is an allowlist of such payloads by content digest: set
it on a backend (``backend.trust_policy = policy``) and
:meth:`~accy_async.backends.Backend.create_artifact` refuses every CUDA
payload it does not list, with :class:`UntrustedKernel`, before anything is
compiled or loaded. Without a policy a backend runs what the application
hands it: the application is then the one that decides.

The digest covers the format, the kernel's name and the payload's bytes, not
the compile options (which :mod:`accy_async.plan` limits to options that
read nothing from the host), so the tuning candidates of a trusted kernel
stay trusted. ``docs/security.md`` has the whole model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import UntrustedKernel
from .plan import ArtifactFormat, ArtifactSpec, BinaryPayload, KernelCallRegistry, TextPayload

__all__ = [
    "TrustPolicy",
    "builtin_digests",
    "kernel_digest",
    "read_trust_file",
    "registry_digests",
]

_PREFIX = "sha256:"


def kernel_digest(spec: ArtifactSpec) -> str | None:
    """The content digest of a CUDA kernel (``sha256:<hex>``); ``None`` for a CPU kernel."""
    payload = spec.payload
    if isinstance(payload, TextPayload):
        data = payload.text.encode()
    elif isinstance(payload, BinaryPayload):
        data = payload.data
    else:
        return None
    digest = hashlib.sha256()
    for part in (spec.format.value.encode(), spec.kernel_name.encode(), data):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return _PREFIX + digest.hexdigest()


def registry_digests(registry: KernelCallRegistry) -> list[tuple[int, str]]:
    """``(entry index, digest)`` of every CUDA kernel in ``registry``."""
    found = []
    for index, entry in enumerate(registry.entries):
        digest = kernel_digest(entry.artifact_spec())
        if digest is not None:
            found.append((index, digest))
    return found


@functools.cache
def builtin_digests() -> frozenset[str]:
    """The digests of every CUDA kernel the library ships (its plans and tuning problems)."""
    from . import library

    registries = [library.load_builtin(name).registry for name in library.BUILTIN_PLANS]
    for dtype in library.BUILTIN_DTYPES:
        for build in (library.prefix_sum, library.saxpy, library.reduce_sum):
            with contextlib.suppress(ValueError):  # not every kernel comes in every type
                registries.append(build(dtype).registry)
    return frozenset(digest for registry in registries for _, digest in registry_digests(registry))


def read_trust_file(path: str | Path) -> frozenset[str]:
    """The digests listed in a trust file: one per line, first word; ``#`` starts a comment.

    Raises :class:`OSError` if it cannot be read and :class:`ValueError`
    naming the line of one that is not a digest.
    """
    digests = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        digest = words[0]
        hex_part = digest.removeprefix(_PREFIX)
        if not digest.startswith(_PREFIX) or len(hex_part) != 64 or not _is_hex(hex_part):
            raise ValueError(f"{path}:{number}: {digest!r} is not a sha256:<64 hex digits> digest")
        digests.add(digest)
    return frozenset(digests)


def _is_hex(text: str) -> bool:
    return all(char in "0123456789abcdef" for char in text)


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    """CUDA kernels allowed to compile and load, by digest (see :func:`kernel_digest`).

    ``TrustPolicy.builtin()`` trusts the library's own kernels;
    ``policy.extended(digests)`` adds others. CPU kernels are always allowed:
    a plan can only name them, and only the application registers them.
    """

    digests: frozenset[str] = frozenset()

    @classmethod
    def builtin(cls, extra: Iterable[str] = ()) -> TrustPolicy:
        """The library's shipped kernels, and ``extra`` digests."""
        return cls(builtin_digests() | frozenset(extra))

    def extended(self, digests: Iterable[str]) -> TrustPolicy:
        """A copy of the policy that trusts ``digests`` too."""
        return TrustPolicy(self.digests | frozenset(digests))

    def allows(self, spec: ArtifactSpec) -> bool:
        """Whether ``spec`` may be compiled and loaded."""
        digest = kernel_digest(spec)
        return digest is None or digest in self.digests

    def check(self, spec: ArtifactSpec, path: str | None = None) -> None:
        """Raise :class:`UntrustedKernel` unless ``spec`` is allowed."""
        digest = kernel_digest(spec)
        if digest is None or digest in self.digests:
            return
        raise UntrustedKernel(
            f"kernel {spec.kernel_name!r} ({spec.format.value}) is not trusted: its digest "
            f"{digest} is in no trust policy of this backend; trust it only if you trust "
            "where the plan came from",
            path=path,
        )

    def check_registry(self, registry: KernelCallRegistry, prefix: str = "$.registry") -> None:
        """Raise :class:`UntrustedKernel` for the first CUDA entry not allowed, with its path."""
        for index, entry in enumerate(registry.entries):
            if entry.format is not ArtifactFormat.CPU:
                self.check(entry.artifact_spec(), f"{prefix}.entries[{index}]")
