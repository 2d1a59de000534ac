"""The kernels the tuning benchmark tunes: the classic autotuning examples, in CUDA C.

* ``sgemm``: C = A B for 2048 x 2048 float32, register-tiled (Kernel Tuner's
  matmul example): tile sizes ``BM x BN`` per block, ``BK`` deep, ``TM x TN``
  outputs per thread, all defines;
* ``convolution``: a 17 x 17 filter over a 4096 x 4096 image (Kernel Tuner's
  convolution example): block shape and ``TX x TY`` outputs per thread;
* ``partial_sum``: the first stage of the library's sum (block size and
  elements per thread), a light kernel beside two heavy ones.

Sizes are multiples of every candidate's tile, so every candidate computes the
same result; :func:`check_sgemm` verifies a candidate against NumPy.
"""

from __future__ import annotations

from typing import Final

import msgspec
import numpy as np

import accy_async as accy
from accy_async import library
from accy_async import plan as p

SGEMM: Final = r"""
extern "C" __global__ void sgemm(float* C, const float* A, const float* B,
                                 unsigned M, unsigned N, unsigned K) {
    __shared__ float As[BK][BM];
    __shared__ float Bs[BK][BN];
    const int threads = (BM / TM) * (BN / TN);
    const int tid = threadIdx.x;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int tr = tid / (BN / TN), tc = tid % (BN / TN);
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
    for (unsigned k0 = 0; k0 < K; k0 += BK) {
        for (int i = tid; i < BM * BK; i += threads) {
            const int r = i / BK, c = i % BK;
            As[c][r] = A[(size_t)(row0 + r) * K + k0 + c];
        }
        for (int i = tid; i < BK * BN; i += threads) {
            const int r = i / BN, c = i % BN;
            Bs[r][c] = B[(size_t)(k0 + r) * N + col0 + c];
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[k][tr * TM + i];
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = Bs[k][tc * TN + j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j)
            C[(size_t)(row0 + tr * TM + i) * N + col0 + tc * TN + j] = acc[i][j];
}
"""

CONVOLUTION: Final = r"""
#define FW 17
#define FH 17
extern "C" __global__ void convolution(float* out, const float* in, const float* filter,
                                       unsigned w, unsigned h) {
    const int x0 = (blockIdx.x * blockDim.x + threadIdx.x) * TX;
    const int y0 = (blockIdx.y * blockDim.y + threadIdx.y) * TY;
    const int iw = w + FW - 1;
    float sum[TY][TX];
#pragma unroll
    for (int ty = 0; ty < TY; ++ty)
#pragma unroll
        for (int tx = 0; tx < TX; ++tx) sum[ty][tx] = 0.0f;
    for (int fy = 0; fy < FH; ++fy) {
#pragma unroll
        for (int fx = 0; fx < FW; ++fx) {
            const float f = filter[fy * FW + fx];
#pragma unroll
            for (int ty = 0; ty < TY; ++ty)
#pragma unroll
                for (int tx = 0; tx < TX; ++tx)
                    sum[ty][tx] += f * in[(size_t)(y0 + ty + fy) * iw + x0 + tx + fx];
        }
    }
#pragma unroll
    for (int ty = 0; ty < TY; ++ty)
#pragma unroll
        for (int tx = 0; tx < TX; ++tx) out[(size_t)(y0 + ty) * w + x0 + tx] = sum[ty][tx];
}
"""

GEMM_SIZE: Final = 2048
IMAGE: Final = 4096
FILTER: Final = 17
SGEMM_TILES: Final = (  # BM, BN, BK, TM, TN
    (64, 64, 8, 4, 4),
    (64, 64, 16, 4, 4),
    (128, 64, 8, 8, 4),
    (64, 128, 8, 4, 8),
    (128, 128, 8, 8, 8),
    (128, 128, 16, 8, 8),
    (32, 32, 8, 2, 2),
    (64, 64, 8, 8, 8),
    (128, 64, 16, 8, 4),
    (128, 128, 8, 8, 4),
)
CONVOLUTION_SHAPES: Final = (  # block x, block y, TX, TY
    (32, 8, 1, 1),
    (16, 16, 1, 1),
    (32, 4, 2, 2),
    (16, 16, 2, 2),
    (32, 8, 4, 1),
    (64, 4, 2, 2),
    (32, 8, 2, 4),
    (16, 8, 4, 4),
    (32, 16, 2, 1),
    (32, 4, 4, 4),
)


def _spec(source: str, name: str, buffers: int, scalars: int) -> p.ArtifactSpec:
    return p.ArtifactSpec(
        kernel_name=name,
        format=p.ArtifactFormat.CUDA_SOURCE,
        payload=p.TextPayload(source),
        argument_count=buffers + scalars,
        scalar_argument_count=scalars,
    )


def _fixed(grid: tuple[int, int], block: tuple[int, int]) -> p.FixedLaunch:
    return p.FixedLaunch(geometry=p.LaunchGeometry(grid=(*grid, 1), block=(*block, 1)))


def sgemm_problem(size: int = GEMM_SIZE) -> p.KernelTuningProblem:
    """SGEMM of ``size`` x ``size`` matrices over :data:`SGEMM_TILES`."""
    matrix = 4 * size * size
    candidates = []
    for bm, bn, bk, tm, tn in SGEMM_TILES:
        threads = (bm // tm) * (bn // tn)
        candidates.append(
            p.TuningCandidate(
                launch=_fixed((size // bn, size // bm), (threads, 1)),
                compile_options=(
                    f"-DBM={bm}",
                    f"-DBN={bn}",
                    f"-DBK={bk}",
                    f"-DTM={tm}",
                    f"-DTN={tn}",
                ),
                label=f"{bm}x{bn}x{bk} tiles, {tm}x{tn} per thread",
            )
        )
    return p.KernelTuningProblem(
        name="sgemm",
        artifact=_spec(SGEMM, "sgemm", 3, 3),
        candidates=tuple(candidates),
        buffers=(
            p.TuningBuffer(byte_size=matrix),
            p.TuningBuffer(byte_size=matrix, initial="random"),
            p.TuningBuffer(byte_size=matrix, initial="random"),
        ),
        scalars=(p.scalar("u32", size), p.scalar("u32", size), p.scalar("u32", size)),
    )


def convolution_problem(image: int = IMAGE) -> p.KernelTuningProblem:
    """A 17 x 17 convolution of an ``image`` x ``image`` picture over :data:`CONVOLUTION_SHAPES`."""
    padded = 4 * (image + FILTER - 1) ** 2
    candidates = tuple(
        p.TuningCandidate(
            launch=_fixed((image // (bx * tx), image // (by * ty)), (bx, by)),
            compile_options=(f"-DTX={tx}", f"-DTY={ty}"),
            label=f"block {bx}x{by}, {tx}x{ty} per thread",
        )
        for bx, by, tx, ty in CONVOLUTION_SHAPES
    )
    return p.KernelTuningProblem(
        name="convolution",
        artifact=_spec(CONVOLUTION, "convolution", 3, 2),
        candidates=candidates,
        buffers=(
            p.TuningBuffer(byte_size=4 * image * image),
            p.TuningBuffer(byte_size=padded, initial="random"),
            p.TuningBuffer(byte_size=4 * FILTER * FILTER, initial="random"),
        ),
        scalars=(p.scalar("u32", image), p.scalar("u32", image)),
    )


def partial_sum_problem(n: int = library.DEFAULT_TUNING_N) -> p.KernelTuningProblem:
    """The library's ``partial_sum`` over block sizes and elements per thread."""
    for problem in library.tuning_document(p.ArtifactFormat.CUDA_SOURCE, n).kernels:
        if problem.name.startswith("partial_sum"):
            return msgspec.structs.replace(problem, name="partial_sum")
    raise LookupError("partial_sum")


def problems() -> list[p.KernelTuningProblem]:
    """The three problems of the benchmark."""
    return [sgemm_problem(), convolution_problem(), partial_sum_problem()]


async def check_sgemm(backend: accy.Backend, problem: p.KernelTuningProblem, index: int) -> float:
    """Run candidate ``index`` on 256 x 256 matrices; the largest error against NumPy."""
    size = 256
    rng = np.random.default_rng(1)
    a = rng.random((size, size), dtype=np.float32)
    b = rng.random((size, size), dtype=np.float32)
    small = sgemm_problem(size)
    artifact = await backend.create_artifact(small.candidate_spec(index))
    loaded = await backend.load_artifact(artifact)
    buffers = [accy.upload(backend, x) for x in (np.zeros_like(a), a, b)]
    grid, block, shared = small.candidates[index].launch.resolve(())
    backend.launch(
        loaded,
        [each.bind() for each in buffers],
        list(small.scalars),
        accy.LaunchConfig(grid, block, shared),
    )
    got = await accy.download(backend, buffers[0], np.float32, size * size)
    backend.destroy_all([*buffers, loaded])
    del problem
    return float(np.abs(got.reshape(size, size) - a @ b).max())
