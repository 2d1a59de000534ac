// out = a * x + y, element-wise; each thread handles ACCY_ITEMS elements, blockDim.x apart,
// so a launch needs ceil(n / (blockDim.x * ACCY_ITEMS)) blocks.
#include "common.cuh"
#ifndef ACCY_ITEMS
#define ACCY_ITEMS 1
#endif

extern "C" __global__ void saxpy(accy_t* out, const accy_t* x, const accy_t* y, unsigned n,
                                 accy_t a) {
    const unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x * ACCY_ITEMS;
#pragma unroll
    for (unsigned k = 0; k < ACCY_ITEMS; ++k) {
        const unsigned long long i = base + (unsigned long long)k * blockDim.x + threadIdx.x;
        if (i < n) out[i] = a * x[i] + y[i];
    }
}
