"""CUDA artifacts: CUDA C compiled by NVRTC (PTX and cubin taken as they are), and their loads.

Both run off the event loop (NVRTC on a worker thread or in the compile pool's
processes, the module load on a worker thread), and both leave at once when
the caller is cancelled without leaking what the worker was still making.
"""

from __future__ import annotations

import hashlib
import threading
from functools import partial
from typing import Any

import anyio.to_thread

from ...errors import InvalidArtifact
from ...plan import ArtifactFormat, ArtifactSpec, BinaryPayload, TextPayload
from .._handles import KernelArtifact
from ..forecast import Forecast
from ._launch import Kernel
from ._memory import Janitor
from .compile_pool import CompilePool
from .driver import driver, translate
from .nvrtc import compile_source

__all__ = ["create_artifact", "load_kernel"]


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
        return KernelArtifact(spec, compiled.image, compiled.kind)
    if spec.format is ArtifactFormat.CUDA_PTX:
        assert isinstance(payload, TextPayload)
        return KernelArtifact(spec, payload.text.encode() + b"\0", "ptx")
    assert isinstance(payload, BinaryPayload)
    return KernelArtifact(spec, payload.data, "cubin")


async def load_kernel(
    context: Any, artifact: KernelArtifact, forecast: Forecast, janitor: Janitor
) -> Kernel:
    """Load ``artifact``'s module in ``context`` and find its kernel, on a worker thread.

    A cancelled caller leaves at once; whichever of the two finishes last
    unloads the module (the caller through ``janitor``: an unload behind a
    running kernel waits for it). The kernel's cost model is shared by every
    load of the same image.
    """
    name = artifact.spec.kernel_name

    lock = threading.Lock()
    state: dict[str, Any] = {}

    def load() -> tuple[Any, Any]:
        d = driver()
        d.cuCtxSetCurrent(context)
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
        module, function = await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
    except BaseException:
        # Cancelled while the worker thread loads: the caller leaves at once, and whichever
        # of the two finishes last unloads the module.
        with lock:
            state["abandoned"] = True
            loaded = state.pop("loaded", None)
        if loaded is not None:
            janitor.submit(f"unloading {name} (its load was cancelled)", partial(_unload, loaded))
        raise
    image = artifact.image if isinstance(artifact.image, bytes) else bytes(artifact.image)
    key = (name, hashlib.blake2b(image, digest_size=16).digest())
    return Kernel(
        module,
        function,
        artifact.spec.argument_count,
        forecast.model(key, name),
    )


def _unload(module: Any) -> Any:
    return driver().cuModuleUnload(module)
