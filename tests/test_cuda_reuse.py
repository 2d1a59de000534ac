"""The CUDA backend's bookkeeping of kept memory blocks and shelved modules (no GPU needed).

Their use by the backend is tested on the GPU in ``test_cuda_driver_hold.py``.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import pytest

from accy_async.backends.cuda._memory import Allocation, BlockCache
from accy_async.backends.cuda._module_shelf import ModuleShelf, ShelvedModule

MiB = 1 << 20


def test_a_kept_block_serves_the_smallest_request_it_fits() -> None:
    cache = BlockCache(limit=16 * MiB)
    assert cache.keep(Allocation(0x10000000, 0x10000000, 4 * MiB))
    assert cache.keep(Allocation(0x20000000, 0x20000000, MiB))
    assert cache.held == 5 * MiB
    taken = cache.take(MiB - 512, 256)
    assert taken is not None
    assert (taken.base, taken.address, taken.capacity) == (0x20000000, 0x20000000, MiB)
    assert cache.take(MiB - 512, 256) is None  # the 4 MiB block is far too large for it
    taken = cache.take(int(3.5 * MiB), 256)
    assert taken is not None and taken.capacity == 4 * MiB
    assert (cache.held, cache.taken) == (0, 2)


def test_a_small_request_may_take_up_to_64_kib_to_spare() -> None:
    cache = BlockCache(limit=MiB)
    cache.keep(Allocation(0x1000, 0x1000, 64 * 1024))
    assert cache.take(16, 256) is not None  # 64 KiB spare at most
    cache.keep(Allocation(0x1000, 0x1000, 128 * 1024))
    assert cache.take(16, 256) is None


def test_a_block_is_kept_only_within_the_limit() -> None:
    cache = BlockCache(limit=2 * MiB)
    assert cache.keep(Allocation(0x1000, 0x1000, MiB))
    assert not cache.keep(Allocation(0x2000, 0x2000, 2 * MiB))  # the caller frees it
    assert cache.held == MiB
    assert not BlockCache(limit=0).keep(Allocation(0x1000, 0x1000, 512))


def test_alignment_is_honoured_or_the_block_left() -> None:
    cache = BlockCache(limit=8 * MiB)
    cache.keep(Allocation(0x10000200, 0x10000200, MiB))  # 512-byte aligned only
    assert cache.take(MiB, 4096) is None  # padding to 4096 would overrun it
    taken = cache.take(MiB - 8192, 4096)
    assert taken is not None
    assert taken.address % 4096 == 0 and taken.address + MiB - 8192 <= taken.base + MiB


def test_drain_hands_back_every_block() -> None:
    cache = BlockCache(limit=8 * MiB)
    for base in (0x1000, 0x2000, 0x3000):
        cache.keep(Allocation(base, base, MiB))
    assert sorted(cache.drain()) == [0x1000, 0x2000, 0x3000]
    assert cache.held == 0 and cache.take(MiB, 256) is None


def test_the_shelf_returns_a_module_of_the_same_image_only() -> None:
    shelf = ModuleShelf(capacity=4)
    key, other = ("k", 1, b"\x01" * 16), ("k", 1, b"\x02" * 16)
    assert shelf.keep(key, ShelvedModule("module-1", "function-1", None)) == []
    assert shelf.take(other) is None
    shelved = shelf.take(key)
    assert shelved == ShelvedModule("module-1", "function-1", None)
    assert shelf.take(key) is None
    assert (len(shelf), shelf.taken) == (0, 1)


def test_the_shelf_pushes_out_the_least_recently_shelved() -> None:
    shelf = ModuleShelf(capacity=2)
    first, second, third = (("k", 1, bytes([i]) * 16) for i in range(3))
    shelf.keep(first, ShelvedModule("m1", "f1", "no table"))
    shelf.keep(second, ShelvedModule("m2", "f2", None))
    evicted = shelf.keep(third, ShelvedModule("m3", "f3", None))
    assert evicted == [ShelvedModule("m1", "f1", "no table")]
    assert shelf.take(first) is None
    assert sorted(module for module, _, _ in shelf.drain()) == ["m2", "m3"]
    assert len(shelf) == 0
    assert ModuleShelf(capacity=0).keep(first, ShelvedModule("m", "f", None)) == [
        ShelvedModule("m", "f", None)
    ]


def test_two_loads_of_one_image_are_both_kept() -> None:
    shelf = ModuleShelf(capacity=4)
    key = ("k", 1, b"\x01" * 16)
    shelf.keep(key, ShelvedModule("m1", "f1", None))
    shelf.keep(key, ShelvedModule("m2", "f2", None))
    assert {shelf.take(key), shelf.take(key)} == {
        ShelvedModule("m1", "f1", None),
        ShelvedModule("m2", "f2", None),
    }


class _Driver:
    """Stands in for cuda-python's driver module on a machine without CUDA: the janitor's
    thread only makes its context current and waits for the device, both recorded."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def cuCtxSetCurrent(self, context: object) -> tuple[int]:
        self.calls.append("current")
        return (0,)

    def cuCtxSynchronize(self) -> tuple[int]:
        self.calls.append("quiet")
        return (0,)


def test_the_janitor_waits_once_per_batch_runs_it_in_order_and_stops_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accy_async.backends.cuda import _memory

    calls: list[str] = []
    monkeypatch.setattr(_memory, "driver", lambda: _Driver(calls))
    gate = threading.Event()
    janitor = _memory.Janitor(context=None)
    janitor.submit("held", gate.wait)  # the rest queue up behind it: one batch
    for index in range(3):
        janitor.submit(f"work {index}", partial(calls.append, f"work {index}"))
    janitor.submit("a failed free", lambda: (1,))  # a CUresult that is not success
    janitor.submit("a raising one", lambda: 1 / 0)
    gate.set()
    janitor.close()
    assert calls == ["current", "quiet", "work 0", "work 1", "work 2"]
    assert len(janitor.failures) == 2
    assert janitor.failures[1].startswith("a raising one: ")


class _AllocatingDriver:
    """cuda-python's driver for ``cuMemAlloc``/``cuMemFree`` on a device that holds
    ``free_bytes`` (freed memory counts again), with the real ``CUresult`` values."""

    def __init__(self, free_bytes: int) -> None:
        from cuda.bindings import driver as real

        self.CUresult = real.CUresult
        self.free_bytes = free_bytes
        self.calls: list[str] = []
        self.sizes: dict[int, int] = {}
        self._next = 1 << 32

    def cuMemAlloc(self, size: int) -> tuple[object, int]:
        self.calls.append(f"alloc {size}")
        if size > self.free_bytes:
            return self.CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0
        self.free_bytes -= size
        pointer, self._next = self._next, self._next + size
        self.sizes[pointer] = size
        return self.CUresult.CUDA_SUCCESS, pointer

    def cuMemFree(self, pointer: int) -> tuple[object]:
        self.calls.append(f"free {pointer:#x}")
        self.free_bytes += self.sizes.pop(pointer)
        return (self.CUresult.CUDA_SUCCESS,)


def _device_state_allocating(
    monkeypatch: pytest.MonkeyPatch, free_bytes: int
) -> tuple[_AllocatingDriver, Any]:
    """``DeviceState.allocate`` bound to a kept-block cache and a stand-in driver."""
    from types import SimpleNamespace

    from accy_async.backends.cuda import _device
    from accy_async.backends.cuda._device import DeviceState, DriverResults

    fake = _AllocatingDriver(free_bytes)
    monkeypatch.setattr(_device, "driver", lambda: fake)
    results = DriverResults(poison=lambda fault: None)
    state: Any = SimpleNamespace(blocks=BlockCache(limit=16 * MiB), value=results.value)
    state.allocate = partial(DeviceState.allocate, state)
    return fake, state


def test_kept_blocks_are_freed_when_an_allocation_runs_out_of_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any allocation of the context (a buffer's, a graph's argument table) drains the kept
    blocks and tries again, rather than fail while memory it holds could serve it."""
    fake, state = _device_state_allocating(monkeypatch, free_bytes=3 * MiB)
    kept = [state.allocate(MiB, "a buffer") for _ in range(3)]
    for pointer in kept:
        assert state.blocks.keep(Allocation(pointer, pointer, MiB))
    fake.calls.clear()
    table = state.allocate(2 * MiB, "allocating a graph's argument table")
    assert fake.calls[0] == f"alloc {2 * MiB}"  # out of memory: every kept block is freed
    assert sorted(fake.calls[1:4]) == sorted(f"free {pointer:#x}" for pointer in kept)
    assert fake.calls[4:] == [f"alloc {2 * MiB}"]
    assert table in fake.sizes and not state.blocks.held


def test_an_allocation_with_nothing_kept_fails_naming_what_it_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accy_async.errors import OutOfDeviceMemory

    fake, state = _device_state_allocating(monkeypatch, free_bytes=MiB)
    with pytest.raises(OutOfDeviceMemory, match="allocating a graph's argument table failed"):
        state.allocate(2 * MiB, "allocating a graph's argument table")
    assert fake.calls == [f"alloc {2 * MiB}"]  # nothing kept: no second try


def test_only_modules_whose_ptx_declares_no_variables_may_be_shelved() -> None:
    shelf = ModuleShelf()
    plain = b".visible .entry k(\n.param .u64 k_param_0\n)\n{\nret;\n}\n"
    stateful = b".global .align 4 .u32 counter;\n" + plain
    assert shelf.may_keep(b"plain", plain)
    assert not shelf.may_keep(b"stateful", stateful)
    assert not shelf.may_keep(b"cubin only", b"")  # a cubin alone says nothing: never kept
    # Read once per image: the verdict stands for every later load of the same digest.
    assert shelf.may_keep(b"plain", stateful)
