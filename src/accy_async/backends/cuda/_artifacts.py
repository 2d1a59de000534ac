"""CUDA artifacts: CUDA C compiled by NVRTC (PTX and cubin taken as they are), and their loads.

Both run off the event loop (NVRTC on a worker thread or in the compile pool's
processes, the module load on a worker thread), and both leave at once when
the caller is cancelled without leaking what the worker was still making.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any, Final

import anyio.to_thread

from ...errors import InvalidArtifact
from ...plan import ArtifactFormat, ArtifactSpec, BinaryPayload, TextPayload
from .._handles import KernelArtifact
from ..forecast import Forecast
from ._launch import Kernel, TableKernel
from ._memory import Janitor, quiet_device
from ._module_shelf import ModuleShelf, ShelvedModule
from ._table_ptx import NoTableVariant, table_variant
from .compile_pool import CompilePool
from .driver import driver, translate
from .nvrtc import compile_source

__all__ = [
    "create_artifact",
    "load_kernel",
    "load_table_variants",
    "shelve_kernel",
    "unload_shelved",
]

_logger: Final = logging.getLogger("accy_async")


async def create_artifact(
    spec: ArtifactSpec, compute_capability: tuple[int, int], compile_pool: CompilePool | None
) -> KernelArtifact:
    """The artifact of ``spec``: CUDA C compiled for ``compute_capability``, PTX or cubin as given.

    CUDA C compiles in ``compile_pool`` when there is one, else on a worker thread.
    """
    payload = spec.payload
    if spec.format is ArtifactFormat.CUDA_SOURCE:
        assert isinstance(payload, TextPayload)
        arguments = (
            payload.text,
            spec.kernel_name,
            spec.compile_options,
            compute_capability,
        )
        if compile_pool is not None:
            compiled = await compile_pool.compile(*arguments)
        else:
            # Cancelled, the caller leaves at once; the compile finishes unseen (cached).
            compiled = await anyio.to_thread.run_sync(
                compile_source, *arguments, abandon_on_cancel=True
            )
        return KernelArtifact(spec, compiled.image, compiled.kind, compiled.ptx)
    if spec.format is ArtifactFormat.CUDA_PTX:
        assert isinstance(payload, TextPayload)
        text = payload.text.encode() + b"\0"
        return KernelArtifact(spec, text, "ptx", text)
    assert isinstance(payload, BinaryPayload)
    return KernelArtifact(spec, payload.data, "cubin")


async def load_kernel(
    context: Any,
    artifact: KernelArtifact,
    forecast: Forecast,
    janitor: Janitor,
    shelf: ModuleShelf,
) -> Kernel:
    """Load ``artifact``'s module in ``context`` and find its kernel.

    A module of the same image kept on ``shelf`` (its kernel was destroyed; only
    modules without variables of their own are kept) is taken back with no
    driver call; otherwise a worker thread loads it (:func:`_load_module`). The
    kernel's cost model is shared by every load of the same image.
    """
    name = artifact.spec.kernel_name
    image = artifact.image if isinstance(artifact.image, bytes) else bytes(artifact.image)
    digest = hashlib.blake2b(image, digest_size=16).digest()
    cost = forecast.model((name, digest), name)
    # Only a module with no variables of its own comes back as good as new from the shelf.
    stateless = shelf.may_keep(digest, artifact.ptx)
    key = (name, artifact.spec.argument_count, digest) if stateless else None
    shelved = None if key is None else shelf.take(key)
    if shelved is None:
        module, function = await _load_module(context, artifact, janitor)
        shelved = ShelvedModule(module, function, None)
    kernel = Kernel(
        shelved.module,
        shelved.function,
        artifact.spec.argument_count,
        cost,
        artifact.ptx,
        name,
        key,
    )
    kernel.table = shelved.table
    return kernel


async def _load_module(context: Any, artifact: KernelArtifact, janitor: Janitor) -> tuple[Any, Any]:
    """``artifact``'s module loaded on a worker thread, and its kernel's function.

    The thread first waits for the device's running work (:func:`quiet_device`);
    a caller cancelled meanwhile leaves at once, and the thread loads nothing,
    or whichever of the two finishes last unloads the module (the caller
    through ``janitor``).
    """
    name = artifact.spec.kernel_name
    lock = threading.Lock()
    state: dict[str, Any] = {}

    def load() -> tuple[Any, Any]:
        d = driver()
        d.cuCtxSetCurrent(context)
        quiet_device()
        with lock:
            if state.get("abandoned"):  # cancelled while the device was busy: load nothing
                return None, None
        result, module = d.cuModuleLoadData(artifact.image)
        if int(result):
            raise translate(result, f"loading {name} ({artifact.image_format})")
        result, function = d.cuModuleGetFunction(module, name.encode())
        if int(result):
            d.cuModuleUnload(module)
            raise InvalidArtifact(f"the module has no kernel named {name!r}")
        with lock:
            if state.get("abandoned"):  # the caller was cancelled: nobody will unload it
                d.cuModuleUnload(module)
            else:
                state["loaded"] = module
        return module, function

    try:
        return await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
    except BaseException:
        # Cancelled while the worker thread loads: the caller leaves at once, and whichever
        # of the two finishes last unloads the module.
        with lock:
            state["abandoned"] = True
            loaded = state.pop("loaded", None)
        if loaded is not None:
            janitor.submit(f"unloading {name} (its load was cancelled)", partial(_unload, loaded))
        raise


async def load_table_variants(context: Any, kernels: Sequence[Kernel]) -> None:
    """Make each kernel's argument-table variant (see :mod:`._table_ptx`), on a worker thread.

    Tried once per kernel: the variant's module is JIT-compiled by the driver
    from the kernel's PTX; a kernel without PTX, whose PTX cannot be rewritten,
    or whose rewrite the driver refuses keeps the reason instead (its graph
    nodes are patched by the driver). A cancelled caller leaves at once; the
    worker finishes and hands the module to the kernel, or unloads it when the
    kernel was destroyed meanwhile (shelved or unloaded).
    """
    todo = [kernel for kernel in kernels if kernel.table is None]
    if todo:
        await anyio.to_thread.run_sync(
            partial(_load_table_variants, context, todo), abandon_on_cancel=True
        )


def _load_table_variants(context: Any, kernels: Sequence[Kernel]) -> None:
    d = driver()
    d.cuCtxSetCurrent(context)
    for kernel in kernels:
        with kernel.lock:
            done = kernel.table is not None or kernel.unloaded  # made, or destroyed meanwhile
        if done:
            continue
        made = _table_kernel(kernel)
        if isinstance(made, str):
            _logger.debug(
                "accy-async: %s's graph nodes are patched by the driver: %s", kernel.name, made
            )
        with kernel.lock:
            keep = not kernel.unloaded and kernel.table is None
            if keep:
                kernel.table = made
        if not keep and isinstance(made, TableKernel):  # unloaded, or made twice at once
            d.cuModuleUnload(made.module)


def _table_kernel(kernel: Kernel) -> TableKernel | str:
    """``kernel``'s table variant loaded (in the current context), or why there is none."""
    if not kernel.ptx:
        return "the kernel was loaded without PTX (a cubin, say)"
    try:
        variant = table_variant(kernel.ptx.decode(), kernel.name, kernel.argument_count)
    except NoTableVariant as refusal:
        return str(refusal)
    d = driver()
    quiet_device()  # a load behind a running kernel would hold every other thread's calls
    result, module = d.cuModuleLoadData(variant.ptx.encode() + b"\0")
    if int(result):
        return f"the driver refused its PTX ({translate(result, kernel.name)})"
    result, function = d.cuModuleGetFunction(module, variant.name.encode())
    if int(result):
        d.cuModuleUnload(module)
        return f"the rewritten module has no {variant.name}"
    # JIT-compiled without the compile options the cubin had (--maxrregcount, say), the
    # variant must still take every block the kernel takes.
    limit = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
    _, variant_threads = d.cuFuncGetAttribute(limit, function)
    _, kernel_threads = d.cuFuncGetAttribute(limit, kernel.function)
    if variant_threads < kernel_threads:
        d.cuModuleUnload(module)
        return (
            f"the variant takes blocks of at most {variant_threads} threads, "
            f"the kernel {kernel_threads}"
        )
    return TableKernel(module, function)


def unload_shelved(shelved: ShelvedModule) -> Any:
    """Unload a module pushed off the shelf, and its table variant's (on the janitor's thread).

    The driver's result: the first that failed, else the last.
    """
    d = driver()
    results = []
    if isinstance(shelved.table, TableKernel):
        results.append(d.cuModuleUnload(shelved.table.module))
    results.append(d.cuModuleUnload(shelved.module))
    return next((result for result in results if int(result[0])), results[-1])


def shelve_kernel(kernel: Kernel, shelf: ModuleShelf) -> list[ShelvedModule]:
    """Keep a destroyed kernel's module on ``shelf``; the modules it pushed out, to unload.

    No driver call: its table variant, if a worker thread is still making it,
    is unloaded by that worker (the kernel is marked unloaded here). A module
    that may not be shelved (see :meth:`ModuleShelf.may_keep`) is handed back at once.
    """
    with kernel.lock:
        kernel.unloaded = True
        table = kernel.table
    shelved = ShelvedModule(kernel.module, kernel.function, table)
    if kernel.key is None:
        return [shelved]
    return shelf.keep(kernel.key, shelved)


def _unload(module: Any) -> Any:
    return driver().cuModuleUnload(module)
