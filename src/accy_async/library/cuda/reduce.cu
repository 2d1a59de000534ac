// Sum of n elements in two stages: partial_sum writes one total per block of
// ACCY_ITEMS * blockDim.x elements; final_sum adds the m totals in one block.
#include "common.cuh"
#ifndef ACCY_ITEMS
#define ACCY_ITEMS 4
#endif

extern "C" __global__ void partial_sum(accy_t* partials, const accy_t* in, unsigned n) {
    __shared__ accy_t warp_totals[32];
    const unsigned long long chunk = (unsigned long long)blockDim.x * ACCY_ITEMS;
    const unsigned long long base = (unsigned long long)blockIdx.x * chunk;
    accy_t value = (accy_t)0;
    if (ACCY_WHOLE_VECTORS && base + chunk <= n && accy_aligned16(in)) {
        // A whole chunk: every load a 16-byte vector, a warp's 512 contiguous bytes.
        const uint4* in4 = reinterpret_cast<const uint4*>(in + base);
        accy_t lanes[ACCY_PER_VECTOR];
#pragma unroll
        for (unsigned j = 0; j < ACCY_PER_VECTOR; ++j) lanes[j] = (accy_t)0;
#pragma unroll
        for (unsigned k = 0; k < ACCY_ITEM_VECTORS; ++k) {
            accy_vector v;
            v.raw = in4[k * blockDim.x + threadIdx.x];
#pragma unroll
            for (unsigned j = 0; j < ACCY_PER_VECTOR; ++j) lanes[j] += v.items[j];
        }
#pragma unroll
        for (unsigned j = 0; j < ACCY_PER_VECTOR; ++j) value += lanes[j];
    } else {
#pragma unroll
        for (unsigned k = 0; k < ACCY_ITEMS; ++k) {
            const unsigned long long i = base + (unsigned long long)k * blockDim.x + threadIdx.x;
            if (i < n) value += in[i];
        }
    }
    value = accy_block_sum(value, warp_totals);
    if (threadIdx.x == 0) partials[blockIdx.x] = value;
}

extern "C" __global__ void final_sum(accy_t* out, const accy_t* partials, unsigned m) {
    __shared__ accy_t warp_totals[32];
    // Four independent sums, so four loads are in flight per thread, not one.
    accy_t a = (accy_t)0, b = (accy_t)0, c = (accy_t)0, d = (accy_t)0;
    const unsigned long long stride = blockDim.x;
    unsigned long long i = threadIdx.x;
    for (; i + 3 * stride < m; i += 4 * stride) {
        a += partials[i];
        b += partials[i + stride];
        c += partials[i + 2 * stride];
        d += partials[i + 3 * stride];
    }
    for (; i < m; i += stride) a += partials[i];
    accy_t value = accy_block_sum((a + b) + (c + d), warp_totals);
    if (threadIdx.x == 0) out[0] = value;
}
