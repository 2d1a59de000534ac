// out = a * x + y, element-wise. A block covers blockDim.x * ACCY_ITEMS elements, so a
// launch needs ceil(n / (blockDim.x * ACCY_ITEMS)) blocks; whole blocks over 16-byte aligned
// arrays move 16-byte vectors, the rest element by element (blockDim.x apart).
#include "common.cuh"
#ifndef ACCY_ITEMS
#define ACCY_ITEMS 1
#endif

extern "C" __global__ void saxpy(accy_t* out, const accy_t* x, const accy_t* y, unsigned n,
                                 accy_t a) {
    const unsigned long long chunk = (unsigned long long)blockDim.x * ACCY_ITEMS;
    const unsigned long long base = (unsigned long long)blockIdx.x * chunk;
    if (ACCY_WHOLE_VECTORS && base + chunk <= n && accy_aligned16(out) &&
        accy_aligned16(x) && accy_aligned16(y)) {
        const uint4* x4 = reinterpret_cast<const uint4*>(x + base);
        const uint4* y4 = reinterpret_cast<const uint4*>(y + base);
        uint4* out4 = reinterpret_cast<uint4*>(out + base);
        accy_vector xs[ACCY_ITEM_VECTORS], ys[ACCY_ITEM_VECTORS];
#pragma unroll
        for (unsigned k = 0; k < ACCY_ITEM_VECTORS; ++k) {
            xs[k].raw = x4[k * blockDim.x + threadIdx.x];
            ys[k].raw = y4[k * blockDim.x + threadIdx.x];
        }
#pragma unroll
        for (unsigned k = 0; k < ACCY_ITEM_VECTORS; ++k) {
#pragma unroll
            for (unsigned j = 0; j < ACCY_PER_VECTOR; ++j) {
                xs[k].items[j] = a * xs[k].items[j] + ys[k].items[j];
            }
            out4[k * blockDim.x + threadIdx.x] = xs[k].raw;
        }
        return;
    }
#pragma unroll
    for (unsigned k = 0; k < ACCY_ITEMS; ++k) {
        const unsigned long long i = base + (unsigned long long)k * blockDim.x + threadIdx.x;
        if (i < n) out[i] = a * x[i] + y[i];
    }
}
