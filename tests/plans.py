"""Builders of small artifact plans and launch graphs over the test kernels, for any backend,
and of changed pipeline documents."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

import accy_async as accy
from accy_async import plan as p
from accy_async.kernels import SlotBinding

from .kernels import spec


def planned(
    backend: accy.Backend,
    kernel_id: int,
    name: str,
    output: int,
    inputs: tuple[int, ...] = (),
    *,
    scalars: tuple[p.ScalarArgument, ...] = (),
    **fields: Any,
) -> p.PlannedKernel:
    """A planned kernel running test kernel ``name``; ``scalars``, when given, are its runtime
    scalars' defaults (and so their count)."""
    artifact_changes = fields.pop("artifact_changes", {})
    fields.setdefault("work_item_id", kernel_id)
    if scalars:
        fields["runtime_scalar_argument_count"] = len(scalars)
        fields["runtime_scalar_defaults"] = scalars
    return p.PlannedKernel(
        kernel_id=kernel_id,
        artifact=spec(backend, name, **artifact_changes),
        output_slot_id=output,
        input_slot_ids=inputs,
        **fields,
    )


def elementwise(
    backend: accy.Backend,
    kernel_id: int,
    name: str,
    output: int,
    inputs: tuple[int, ...],
    n: int,
    **fields: Any,
) -> p.PlannedKernel:
    """Test kernel ``name`` over ``n`` elements: ``n`` is its one runtime scalar's default, and
    its grid covers them."""
    return planned(
        backend,
        kernel_id,
        name,
        output,
        inputs,
        scalars=(p.U32(n),),
        launch_resources=geometry(n),
        **fields,
    )


def fill_by_buffer_count(
    backend: accy.Backend, kernel_id: int, output: int, value: int, **fields: Any
) -> p.PlannedKernel:
    """``count_fill_u32``: ``value`` into as many elements of slot ``output`` as the u32 count
    buffer given at launch says."""
    return planned(
        backend,
        kernel_id,
        "count_fill_u32",
        output,
        static_arguments=(p.U32(value),),
        element_count_argument="device_buffer_u32",
        **fields,
    )


def fill_by_scalar_count(
    backend: accy.Backend, kernel_id: int, output: int, value: int, count: int, **fields: Any
) -> p.PlannedKernel:
    """``scalar_count_fill_u32``: ``value`` into the first ``count`` elements of slot
    ``output``, the count a scalar the plan passes."""
    return planned(
        backend,
        kernel_id,
        "scalar_count_fill_u32",
        output,
        static_arguments=(p.U32(value),),
        element_count_argument="scalar_u32",
        element_count_argument_value=count,
        **fields,
    )


def artifact_plan(sizes: Mapping[int, int | None], *kernels: p.PlannedKernel) -> p.ArtifactPlan:
    """A plan of ``kernels`` over one slot per entry of ``sizes`` (slot id: bytes, or ``None``
    for a slot of no stated size)."""
    return p.ArtifactPlan(
        slots=tuple(p.Slot(slot_id=slot_id, byte_size=size) for slot_id, size in sizes.items()),
        kernels=kernels,
    )


def geometry(n: int, block: int = 64) -> p.LaunchResources:
    """Launch resources covering ``n`` elements with one candidate."""
    return p.LaunchResources(
        geometry=p.LaunchGeometry(grid=(max(1, -(-n // block)), 1, 1), block=(block, 1, 1))
    )


def candidates(*blocks: int, grids: tuple[int, ...] = ()) -> p.LaunchResources:
    """Launch resources whose candidates are 1-D blocks of ``blocks`` threads, each on a grid of
    one block or, where ``grids`` is given, of that many blocks."""
    return p.LaunchResources(
        candidates=tuple(
            p.LaunchCandidate(geometry=p.LaunchGeometry(grid=(grid, 1, 1), block=(block, 1, 1)))
            for grid, block in zip(grids or (1,) * len(blocks), blocks, strict=True)
        )
    )


def elementwise_kernels(backend: accy.Backend, n: int) -> tuple[p.PlannedKernel, ...]:
    """Kernels 11-13 over ``n`` floats: copy slot 1 to 2, add one to slot 1 into 3, and add
    slots 2 and 3 into 4 (the middle and end of the test graphs' diamond)."""
    return (
        elementwise(backend, 11, "copy_f32", 2, (1,), n),
        elementwise(backend, 12, "add_one_f32", 3, (1,), n),
        elementwise(backend, 13, "add_f32", 4, (2, 3), n),
    )


def diamond(stream_of: tuple[int | None, int | None, int | None, int | None]) -> p.LaunchGraphPlan:
    """A(0) -> B(1), A -> C(2), B -> D(3), C -> D, over the first four kernels, node ``i`` on
    stream ``stream_of[i]`` (``None``: host order)."""
    nodes = tuple(p.GraphNode(kernel_index=i, stream=s) for i, s in enumerate(stream_of))
    deps = tuple(
        p.GraphDependency(producer_node_index=a, consumer_node_index=b)
        for a, b in ((0, 1), (0, 2), (1, 3), (2, 3))
    )
    streams = max((s for s in stream_of if s is not None), default=-1) + 1
    return p.LaunchGraphPlan(nodes=nodes, dependencies=deps, stream_count=streams)


CHAIN_N = 1024
"""The elements of each slot of :func:`chain_plan`."""
CHAIN_SIZES = dict.fromkeys(range(1, 7), 4 * CHAIN_N)
"""The slots of :func:`chain_plan`: six of ``CHAIN_N`` floats."""


def chain_plan(backend: accy.Backend) -> p.ArtifactPlan:
    """Slot 1 -> slow fill with 3.0 -> copy to 2 -> add_one to 3 -> add(2, 3) into 4; plus a loop
    kernel (add_one, slot 5 into 6)."""
    n = CHAIN_N
    return artifact_plan(
        CHAIN_SIZES,
        planned(
            backend,
            10,
            "slow_fill_f32",
            1,
            scalars=(p.U32(n), p.F32(3.0), p.U64(20_000_000)),
            launch_resources=geometry(n),
        ),
        *elementwise_kernels(backend, n),
        elementwise(backend, 14, "add_one_f32", 6, (5,), n),
    )


def with_payloads(
    document: p.PipelineDocument, payload: Callable[[p.RegistryEntry], p.Payload | None]
) -> p.PipelineDocument:
    """``document`` with each registry entry's payload replaced by ``payload(entry)``, where
    that is not ``None``."""
    entries = []
    for entry in document.registry.entries:
        changed = payload(entry)
        entries.append(
            entry if changed is None else msgspec.structs.replace(entry, payload=changed)
        )
    return msgspec.structs.replace(document, registry=p.KernelCallRegistry(entries=tuple(entries)))


def bind_all(backend: accy.Backend, sizes: Mapping[int, int]) -> list[SlotBinding]:
    """A fresh buffer for each slot."""
    return [
        SlotBinding(slot_id, backend.allocate_buffer(size).bind())
        for slot_id, size in sizes.items()
    ]


def destroy_bindings(backend: accy.Backend, bindings: list[SlotBinding]) -> None:
    backend.destroy_all({id(b.binding.handle): b.binding.handle for b in bindings}.values())
