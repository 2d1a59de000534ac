"""LaunchConfig: a launch's geometry, checked once when made, then immutable."""

from __future__ import annotations

import pytest

import accy_async as accy


def test_a_config_keeps_its_geometry_and_compares_by_it() -> None:
    config = accy.LaunchConfig((4, 2, 1), [128, 1, 1], 256)
    assert config.grid == (4, 2, 1)
    assert config.block == (128, 1, 1)  # a list is taken as a tuple
    assert config.shared_memory_bytes == 256
    assert config.dims == (4, 2, 1, 128, 1, 1, 256)
    assert config == accy.LaunchConfig((4, 2, 1), (128, 1, 1), 256)
    assert config != accy.LaunchConfig((4, 2, 1), (128, 1, 1))
    assert len({config, accy.LaunchConfig((4, 2, 1), (128, 1, 1), 256)}) == 1
    assert "shared_memory_bytes=256" in repr(config)
    with pytest.raises(AttributeError, match="immutable"):
        setattr(config, "grid", (1, 1, 1))  # noqa: B010 - the attribute is read-only


@pytest.mark.parametrize(
    ("grid", "block", "shared", "names"),
    [
        ((0, 1, 1), (1, 1, 1), 0, "grid"),
        ((1, 1), (1, 1, 1), 0, "grid"),
        ((1, 1, 1), (1.0, 1, 1), 0, "block"),
        ((1, 1, 1), (True, 1, 1), 0, "block"),
        ((1, 1, 1), (1, 1, 1), -1, "shared_memory_bytes"),
        ((1, 1, 1), (1, 1, 1), 1 << 21, "shared_memory_bytes"),
    ],
)
def test_a_bad_geometry_is_refused_naming_what_is_wrong(
    grid: object, block: object, shared: object, names: str
) -> None:
    with pytest.raises(accy.LaunchArgumentMismatch, match=names):
        accy.LaunchConfig(grid, block, shared)  # type: ignore[arg-type]


def test_a_config_takes_numpy_ints_and_survives_copy_and_pickle() -> None:
    import copy
    import pickle

    import numpy as np

    config = accy.LaunchConfig((np.int64(8), 1, 1), (np.int32(64), 1, 1))
    assert config.grid == (8, 1, 1) and type(config.grid[0]) is int
    assert copy.copy(config) == copy.deepcopy(config) == pickle.loads(pickle.dumps(config))


async def test_a_launch_given_something_else_than_a_config_is_refused_naming_it() -> None:
    from .kernels import load

    async with accy.open_backend("recording") as backend:
        kernel = await load(backend, "iota_f32")
        out = backend.allocate_buffer(16)
        with pytest.raises(accy.LaunchArgumentMismatch, match=r"\$\.config"):
            backend.launch(kernel, [out.bind()], [accy.U32(4), accy.F32(0)], (1, 1, 1))  # type: ignore[arg-type]
        assert isinstance(backend, accy.RecordingBackend) and not backend.launches
        backend.destroy_all([kernel, out])
