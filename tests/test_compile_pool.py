"""The NVRTC compile pool: worker processes that answer over pipes, errors carried back."""

from __future__ import annotations

import io

import msgspec
import pytest

import accy_async as accy
from accy_async.backends.cuda.compile_pool import (
    CompileLimits,
    CompilePool,
    read_frame,
    write_frame,
)
from accy_async.backends.cuda.nvrtc_worker import serve

from .conftest import needs_gpu

GOOD = 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }'
BAD = 'extern "C" __global__ void k(float* x) { x[0] = undefined_name; }'


def nvrtc_present() -> bool:
    from accy_async.backends.cuda.nvrtc import nvrtc_version

    try:
        nvrtc_version()
    except Exception:  # any failure means no usable NVRTC here
        return False
    return True


def test_frames_round_trip_and_end_cleanly() -> None:
    stream = io.BytesIO()
    write_frame(stream, b"hello")
    write_frame(stream, b"")
    stream.write(b"\x05\x00")  # a truncated header
    stream.seek(0)
    assert read_frame(stream) == b"hello"
    assert read_frame(stream) == b""
    assert read_frame(stream) is None


def test_the_worker_answers_every_request_with_a_reply() -> None:
    requests, replies = io.BytesIO(), io.BytesIO()
    encoder = msgspec.msgpack.Encoder()
    for source in (GOOD, BAD):
        write_frame(requests, encoder.encode([source, "k", ["-DX=1"], [9, 0]]))
    requests.seek(0)
    serve(requests, replies)
    replies.seek(0)
    first = msgspec.msgpack.decode(read_frame(replies) or b"")
    second = msgspec.msgpack.decode(read_frame(replies) or b"")
    assert read_frame(replies) is None
    if nvrtc_present():
        assert first["ok"] and first["kind"] in ("cubin", "ptx") and first["image"]
        assert not second["ok"] and second["error"] == "CompilationError"
        assert "undefined_name" in second["log"]
    else:
        for reply in (first, second):
            assert not reply["ok"] and reply["error"] == "RuntimeUnavailable"
            assert "NVRTC" in reply["message"]


async def test_a_pool_carries_results_and_errors_back() -> None:
    pool = CompilePool(2)
    try:
        if nvrtc_present():
            image = await pool.compile(GOOD, "k", ("-DPOOL=1",), (9, 0))
            assert image.image
            with pytest.raises(accy.CompilationError, match="undefined_name"):
                await pool.compile(BAD, "k", (), (9, 0))
        else:
            with pytest.raises(accy.RuntimeUnavailable, match="NVRTC"):
                await pool.compile(GOOD, "k", ("-DPOOL=2",), (9, 0))
    finally:
        pool.close()
    with pytest.raises(accy.RuntimeUnavailable, match="shut down"):
        await pool.compile(GOOD, "k", ("-DPOOL=3",), (9, 0))


@pytest.mark.gpu
@needs_gpu
async def test_parallel_compilation_on_the_gpu_loads_kernels_that_run() -> None:
    async with accy.open_backend("cuda") as backend, backend.parallel_compilation(4):
        spec = accy.ArtifactSpec(
            kernel_name="k",
            format=accy.ArtifactFormat.CUDA_SOURCE,
            payload=accy.plan.TextPayload(GOOD),
            argument_count=1,
        )
        loaded = await backend.load_artifact(await backend.create_artifact(spec))
        out = backend.allocate_buffer(4)
        backend.launch(loaded, [out.bind()], [], accy.LaunchConfig((1, 1, 1), (1, 1, 1)))
        got = await accy.download(backend, out, "float32", 1)
        assert got[0] == 1.0
        bad = msgspec.structs.replace(spec, payload=accy.plan.TextPayload(BAD))
        with pytest.raises(accy.CompilationError, match="undefined_name"):
            await backend.create_artifact(bad)
        backend.destroy_all([loaded, out])


BOMB = """
template <int N, long K> struct Bomb {
    static constexpr long v = Bomb<N - 1, 2 * K>::v + Bomb<N - 1, 2 * K + 1>::v;
};
template <long K> struct Bomb<0, K> { static constexpr long v = K; };
extern "C" __global__ void k(long* out) { out[0] = Bomb<26, 1>::v; }
"""
"""A source whose templates instantiate 2**26 types: minutes and gigabytes to compile."""


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (CompileLimits(cpu_seconds=1.5, wall_seconds=60), "CPU-time limit of 1.5 s"),
        (CompileLimits(cpu_seconds=60, wall_seconds=1.5), "wall-clock limit of 1.5 s"),
    ],
)
async def test_a_compile_bomb_is_stopped_at_its_limit_and_the_pool_goes_on(
    limits: CompileLimits, message: str
) -> None:
    if not nvrtc_present():
        pytest.skip("no NVRTC here")
    pool = CompilePool(1, limits)
    try:
        with pytest.raises(accy.CompilationError, match=message):
            await pool.compile(BOMB, "k", (), (9, 0))
        image = await pool.compile(GOOD, "k", (f"-DAFTER_{limits.cpu_seconds:.0f}=1",), (9, 0))
        assert image.image
    finally:
        pool.close()
