// Shared helpers of the built-in kernels. ACCY_T is the element type, set by the
// registry entry's compile options (-DACCY_T=float, say).
#ifndef ACCY_T
#define ACCY_T float
#endif
typedef ACCY_T accy_t;

// Inclusive scan of one value per thread across the block (blockDim.x a multiple of 32,
// at most 1024). `warp_totals` is shared scratch of 32 elements. Every thread must call it.
__device__ __forceinline__ accy_t accy_block_inclusive_scan(accy_t value, accy_t* warp_totals) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned warps = (blockDim.x + 31u) >> 5;
#pragma unroll
    for (unsigned offset = 1; offset < 32; offset <<= 1) {
        accy_t other = __shfl_up_sync(0xffffffffu, value, offset);
        if (lane >= offset) value += other;
    }
    if (lane == 31) warp_totals[warp] = value;
    __syncthreads();
    if (warp == 0) {
        accy_t total = lane < warps ? warp_totals[lane] : (accy_t)0;
#pragma unroll
        for (unsigned offset = 1; offset < 32; offset <<= 1) {
            accy_t other = __shfl_up_sync(0xffffffffu, total, offset);
            if (lane >= offset) total += other;
        }
        warp_totals[lane] = total;
    }
    __syncthreads();
    if (warp > 0) value += warp_totals[warp - 1];
    __syncthreads();  // warp_totals may be reused by the caller's next scan
    return value;
}

// Sum of one value per thread across the block; the result is valid in thread 0.
__device__ __forceinline__ accy_t accy_block_sum(accy_t value, accy_t* warp_totals) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned warps = (blockDim.x + 31u) >> 5;
#pragma unroll
    for (unsigned offset = 16; offset > 0; offset >>= 1) {
        value += __shfl_down_sync(0xffffffffu, value, offset);
    }
    if (lane == 0) warp_totals[warp] = value;
    __syncthreads();
    if (warp == 0) {
        value = lane < warps ? warp_totals[lane] : (accy_t)0;
#pragma unroll
        for (unsigned offset = 16; offset > 0; offset >>= 1) {
            value += __shfl_down_sync(0xffffffffu, value, offset);
        }
    }
    __syncthreads();
    return value;
}

// ACCY_T elements as one 16-byte vector: aligned loads and stores of 16 bytes per thread
// keep enough bytes in flight to reach the memory's bandwidth.
#define ACCY_PER_VECTOR (16u / (unsigned)sizeof(accy_t))
// Vectors per thread for ACCY_ITEMS elements per thread (at least 1, so arrays of them compile
// when ACCY_ITEMS is not a whole number of vectors and the vector path is never taken).
#define ACCY_ITEM_VECTORS \
    (ACCY_ITEMS / ACCY_PER_VECTOR > 0 ? ACCY_ITEMS / ACCY_PER_VECTOR : 1u)
#define ACCY_WHOLE_VECTORS (ACCY_ITEMS % ACCY_PER_VECTOR == 0)
union accy_vector {
    uint4 raw;
    accy_t items[16 / sizeof(accy_t)];
};

__device__ __forceinline__ bool accy_aligned16(const void* pointer) {
    return (reinterpret_cast<unsigned long long>(pointer) & 15ull) == 0;
}
