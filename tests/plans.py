"""Builders of small artifact plans over the test kernels, for any backend."""

from __future__ import annotations

from typing import Any

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
    **fields: Any,
) -> p.PlannedKernel:
    """A planned kernel running test kernel ``name``."""
    artifact_changes = fields.pop("artifact_changes", {})
    fields.setdefault("work_item_id", kernel_id)
    return p.PlannedKernel(
        kernel_id=kernel_id,
        artifact=spec(backend, name, **artifact_changes),
        output_slot_id=output,
        input_slot_ids=inputs,
        **fields,
    )


def slots(*ids_and_sizes: tuple[int, int | None]) -> tuple[p.Slot, ...]:
    return tuple(p.Slot(slot_id=slot_id, byte_size=size) for slot_id, size in ids_and_sizes)


def geometry(n: int, block: int = 64) -> p.LaunchResources:
    """Launch resources covering ``n`` elements with one candidate."""
    return p.LaunchResources(
        geometry=p.LaunchGeometry(grid=(max(1, -(-n // block)), 1, 1), block=(block, 1, 1))
    )


def elementwise_kernels(backend: accy.Backend, n: int) -> tuple[p.PlannedKernel, ...]:
    """Kernels 11-13 over ``n`` floats: copy slot 1 to 2, add one to slot 1 into 3, and add
    slots 2 and 3 into 4 (the middle and end of the test graphs' diamond)."""
    count = (p.U32(n),)
    return tuple(
        planned(
            backend,
            kernel_id,
            name,
            output,
            inputs,
            runtime_scalar_argument_count=1,
            runtime_scalar_defaults=count,
            launch_resources=geometry(n),
        )
        for kernel_id, name, output, inputs in (
            (11, "copy_f32", 2, (1,)),
            (12, "add_one_f32", 3, (1,)),
            (13, "add_f32", 4, (2, 3)),
        )
    )


def bind_all(backend: accy.Backend, sizes: dict[int, int]) -> list[SlotBinding]:
    """A fresh buffer for each slot."""
    return [
        SlotBinding(slot_id, backend.allocate_buffer(size).bind())
        for slot_id, size in sizes.items()
    ]


def destroy_bindings(backend: accy.Backend, bindings: list[SlotBinding]) -> None:
    backend.destroy_all({id(b.binding.handle): b.binding.handle for b in bindings}.values())
