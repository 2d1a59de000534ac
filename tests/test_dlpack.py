"""DLPack consumed by hand (ctypes), checked on NumPy's CPU capsules, both versions."""

from __future__ import annotations

import gc
import sys
from typing import Any

import numpy as np
import pytest

from accy_async.dlpack import CPU, consume


class Legacy:
    """A producer from before DLPack 1.0: no ``max_version``, a plain ``dltensor`` capsule."""

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __dlpack__(self, stream: Any = None) -> Any:
        return self.array.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (CPU, 0)


@pytest.mark.parametrize("wrap", [lambda a: a, Legacy], ids=["versioned", "legacy"])
def test_a_consumed_tensor_is_where_and_what_the_producer_says(wrap: Any) -> None:
    array = np.arange(12, dtype=np.float32)
    before = sys.getrefcount(array)
    view = consume(wrap(array))
    assert view.address == array.ctypes.data
    assert (view.device_type, view.device_id) == (CPU, 0)
    assert view.dtype == np.float32
    assert view.shape == (12,)
    assert view.size == 12 and view.nbytes == 48
    assert view.contiguous
    assert sys.getrefcount(array) > before  # the producer holds it for us
    view.release()
    view.release()  # once only
    assert sys.getrefcount(array) == before


def test_strides_offsets_types_and_read_only() -> None:
    base = np.arange(20, dtype=np.int64)
    view = consume(base[3::2])
    assert view.address == base[3:].ctypes.data
    assert view.strides == (2,) and not view.contiguous
    assert view.dtype == np.int64
    view.release()
    for dtype in (np.int8, np.uint16, np.int32, np.uint64, np.float16, np.float64, np.bool_):
        each = consume(np.zeros(3, dtype))
        assert each.dtype == np.dtype(dtype), dtype
        each.release()
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    view = consume(frozen)
    assert view.readonly
    view.release()
    matrix = consume(np.zeros((3, 4), np.float32))
    assert matrix.shape == (3, 4) and matrix.contiguous and matrix.size == 12
    matrix.release()


def test_a_view_dropped_unreleased_still_calls_the_deleter() -> None:
    array = np.ones(8, np.float32)
    before = sys.getrefcount(array)
    view = consume(array)
    del view
    gc.collect()
    assert sys.getrefcount(array) == before


def test_objects_without_dlpack_are_refused() -> None:
    with pytest.raises(TypeError, match="has no __dlpack__"):
        consume([1, 2, 3])

    class Liar:
        def __dlpack__(self, **_: Any) -> Any:
            return object()

    with pytest.raises(TypeError, match="no DLPack capsule"):
        consume(Liar())
