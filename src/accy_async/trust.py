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

The digest covers the format, the kernel's name, the payload's bytes, the
compile options and the argument layout (see :func:`kernel_digest`): a
trusted kernel compiled with other macros, or called with a scalar where a
buffer goes, is another kernel. The library's own kernels, with every
option its tuning tries, are :func:`builtin_digests`. ``docs/security.md``
has the whole model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import UntrustedKernel
from .plan import ArtifactFormat, ArtifactSpec, BinaryPayload, KernelCallRegistry, TextPayload

__all__ = [
    "TrustPolicy",
    "builtin_digests",
    "document_digests",
    "kernel_digest",
    "read_trust_file",
    "registry_digests",
]

_PREFIX = "sha256:"


def kernel_digest(spec: ArtifactSpec) -> str | None:
    """The content digest of a CUDA kernel (``sha256:<hex>``); ``None`` for a CPU kernel.

    It covers everything that decides what runs and how it is called: the
    format, the kernel's name, the payload, the compile options (a macro can
    rewrite the source) and the argument layout (how many buffers, how many
    scalars: a scalar in a pointer's place would be an address of the plan's
    choosing).
    """
    payload = spec.payload
    if isinstance(payload, TextPayload):
        data = payload.text.encode()
    elif isinstance(payload, BinaryPayload):
        data = payload.data
    else:
        return None
    parts = [
        spec.format.value.encode(),
        spec.kernel_name.encode(),
        data,
        str(spec.argument_count).encode(),
        str(spec.scalar_argument_count).encode(),
        *(option.encode() for option in spec.compile_options),
    ]
    digest = hashlib.sha256()
    digest.update(len(parts).to_bytes(8, "little"))
    for part in parts:
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


def document_digests(document: object) -> list[tuple[str, str, str]]:
    """``(digest, path, what)`` of every CUDA kernel a plan or tuning document can compile.

    A tuning document's kernel problems compile each candidate with its own
    options: each is listed.
    """
    from .plan import LaunchGraphDocument, PipelineDocument, TuningDocument

    if isinstance(document, PipelineDocument):
        return _registry_rows(document.registry, "$.registry")
    if isinstance(document, LaunchGraphDocument):
        rows = []
        for index, kernel in enumerate(document.artifact_plan.kernels):
            digest = kernel_digest(kernel.artifact)
            if digest is not None:
                what = f"{kernel.artifact.kernel_name} ({kernel.artifact.format.value})"
                rows.append((digest, f"$.artifact_plan.kernels[{index}].artifact", what))
        return rows
    if not isinstance(document, TuningDocument):
        raise TypeError(f"not a plan or tuning document: {type(document).__name__}")
    rows = []
    for index, problem in enumerate(document.kernels):
        for candidate in range(len(problem.candidates)):
            spec = problem.candidate_spec(candidate)
            digest = kernel_digest(spec)
            if digest is not None:
                path = f"$.kernels[{index}].candidates[{candidate}]"
                rows.append((digest, path, f"{problem.name} ({spec.format.value})"))
    for index, pipeline in enumerate(document.pipelines):
        for candidate, each in enumerate(pipeline.candidates):
            prefix = f"$.pipelines[{index}].candidates[{candidate}].registry"
            rows.extend(_registry_rows(each.registry, prefix))
    return rows


def _registry_rows(registry: KernelCallRegistry, prefix: str) -> list[tuple[str, str, str]]:
    return [
        (
            digest,
            f"{prefix}.entries[{index}]",
            f"{registry.entries[index].target} ({registry.entries[index].format.value})",
        )
        for index, digest in registry_digests(registry)
    ]


@functools.cache
def builtin_digests() -> frozenset[str]:
    """The digests of every CUDA kernel the library ships: its plans and tuning problems."""
    from . import library
    from .library.tuning import tuning_document

    documents: list[object] = [library.load_builtin(name) for name in library.BUILTIN_PLANS]
    for dtype in library.SUPPORTED_DTYPES:
        for build in (library.prefix_sum, library.saxpy, library.reduce_sum):
            with contextlib.suppress(ValueError):  # not every kernel comes in every type
                documents.append(build(dtype))
        with contextlib.suppress(ValueError):
            documents.append(tuning_document(ArtifactFormat.CUDA_SOURCE, dtype=dtype))
    return frozenset(row[0] for document in documents for row in document_digests(document))


def read_trust_file(path: str | Path) -> frozenset[str]:
    """The digests listed in a trust file: one per line, first word; ``#`` starts a comment.

    Raises :class:`OSError` if it cannot be read and :class:`ValueError`
    naming the line of one that is not a digest.
    """
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a text file ({exc.reason})") from exc
    digests = set()
    for number, line in enumerate(text.splitlines(), 1):
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
            f"{digest} is not in the backend's trust policy",
            path=path,
        )

    def check_registry(
        self,
        registry: KernelCallRegistry,
        prefix: str = "$.registry",
        formats: Collection[ArtifactFormat] | None = None,
    ) -> None:
        """Raise :class:`UntrustedKernel` for the first CUDA entry not allowed, with its path.

        With ``formats``, only entries in those formats (a backend's) are checked.
        """
        for index, entry in enumerate(registry.entries):
            if entry.format is not ArtifactFormat.CPU and (
                formats is None or entry.format in formats
            ):
                self.check(entry.artifact_spec(), f"{prefix}.entries[{index}]")
