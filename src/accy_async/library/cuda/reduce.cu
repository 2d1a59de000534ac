// Sum of n elements in two stages: partial_sum writes one total per block of
// ACCY_ITEMS * blockDim.x elements; final_sum adds the m totals in one block.
#include "common.cuh"
#ifndef ACCY_ITEMS
#define ACCY_ITEMS 4
#endif

extern "C" __global__ void partial_sum(accy_t* partials, const accy_t* in, unsigned n) {
    __shared__ accy_t warp_totals[32];
    const unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x * ACCY_ITEMS;
    accy_t value = (accy_t)0;
#pragma unroll
    for (unsigned k = 0; k < ACCY_ITEMS; ++k) {
        const unsigned long long i = base + (unsigned long long)k * blockDim.x + threadIdx.x;
        if (i < n) value += in[i];
    }
    value = accy_block_sum(value, warp_totals);
    if (threadIdx.x == 0) partials[blockIdx.x] = value;
}

extern "C" __global__ void final_sum(accy_t* out, const accy_t* partials, unsigned m) {
    __shared__ accy_t warp_totals[32];
    accy_t value = (accy_t)0;
    for (unsigned long long i = threadIdx.x; i < m; i += blockDim.x) value += partials[i];
    value = accy_block_sum(value, warp_totals);
    if (threadIdx.x == 0) out[0] = value;
}
