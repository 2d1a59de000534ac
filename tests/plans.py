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


def bind_all(backend: accy.Backend, sizes: dict[int, int]) -> list[SlotBinding]:
    """A fresh buffer for each slot."""
    return [
        SlotBinding(slot_id, backend.allocate_buffer(size).bind())
        for slot_id, size in sizes.items()
    ]


def destroy_bindings(backend: accy.Backend, bindings: list[SlotBinding]) -> None:
    backend.destroy_all({id(b.binding.handle): b.binding.handle for b in bindings}.values())
