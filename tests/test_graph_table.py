"""The CUDA graph's argument table, packed on the host (no GPU needed).

Nodes that share argument objects are packed once each and joined; the bytes
must be exactly those of packing every node in one go, for any mix of buffer
counts and scalar types, with each node at its aligned place.
"""

from __future__ import annotations

import ctypes
import random
import struct
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from accy_async import plan as p
from accy_async.backends.cuda import _graphs
from accy_async.backends.cuda._graphs import CudaGraph, _pack_table, _table_bytes

SCALARS: list[Callable[[random.Random], p.ScalarArgument]] = [
    lambda r: p.U32(r.randrange(2**32)),
    lambda r: p.I32(r.randrange(-(2**31), 2**31)),
    lambda r: p.F32(r.choice([0.5, -2.25, 1e3])),
    lambda r: p.U64(r.randrange(2**64)),
    lambda r: p.I64(r.randrange(-(2**63), 2**63)),
    lambda r: p.F64(r.random()),
]


def _arguments(r: random.Random) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    buffers = tuple(SimpleNamespace(address=r.randrange(2**48)) for _ in range(r.randrange(4)))
    scalars = tuple(r.choice(SCALARS)(r) for _ in range(r.randrange(4)))
    return buffers, scalars


def _graph(arguments: list[tuple[tuple[Any, ...], tuple[Any, ...]]]) -> CudaGraph:
    built = CudaGraph()
    offset = 0
    for buffers, scalars in arguments:
        taken = _table_bytes(len(buffers) + len(scalars))
        built.nodes.append(SimpleNamespace(table_offset=offset, table_bytes=taken))  # type: ignore[arg-type]
        offset += taken
    built.table_size = offset
    built.staging = ctypes.create_string_buffer(offset)
    return built


CODES = {"u32": "<I", "i32": "<i", "f32": "<f", "u64": "<Q", "i64": "<q", "f64": "<d"}


@pytest.mark.parametrize("seed", range(20))
def test_shared_arguments_are_packed_once_to_the_same_bytes(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    joined: list[int] = []
    join = _graphs._join_shared

    def counted(*arguments: Any) -> None:
        joined.append(1)
        join(*arguments)

    monkeypatch.setattr(_graphs, "_join_shared", counted)
    r = random.Random(seed)
    kinds = [_arguments(r) for _ in range(r.randrange(1, 6))]
    nodes = [r.choice(kinds) for _ in range(r.randrange(2, 40))]  # shared objects
    if len({id(each) for each in nodes}) * 2 > len(nodes):
        nodes = nodes + [kinds[0]] * len(nodes)  # keep it at most half distinct
    shared = _graph(nodes)
    _pack_table(shared, tuple(nodes))
    assert joined == [1]
    apart = _graph(nodes)  # the same values in objects of their own: one pack for all
    _pack_table(apart, tuple((tuple(b), tuple(s)) for b, s in nodes))
    assert joined == [1]
    assert shared.staging.raw == apart.staging.raw
    for state, (buffers, scalars) in zip(apart.nodes, nodes, strict=True):
        first = state.table_offset
        for index, binding in enumerate(buffers):
            (address,) = struct.unpack_from("<Q", apart.staging.raw, first + 8 * index)
            assert address == binding.address
        for index, scalar in enumerate(scalars, start=len(buffers)):
            raw = apart.staging.raw
            (value,) = struct.unpack_from(CODES[scalar.type_name], raw, first + 8 * index)
            assert value == pytest.approx(scalar.value, rel=1e-6)
