// Inclusive prefix sum in three stages (the seed's device scan):
//   block_scan: each block scans its tile of blockDim.x elements and writes its total;
//   sums_scan:  one block scans the block totals, looping over them with a running carry,
//               so any number of blocks works (n larger than one block squared);
//   add_base:   every block after the first adds the scanned total of the blocks before it.
#include "common.cuh"

extern "C" __global__ void block_scan(accy_t* out, const accy_t* in, accy_t* block_sums,
                                      unsigned n) {
    __shared__ accy_t warp_totals[32];
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    accy_t value = i < n ? in[i] : (accy_t)0;
    value = accy_block_inclusive_scan(value, warp_totals);
    if (i < n) out[i] = value;
    if (threadIdx.x == blockDim.x - 1) block_sums[blockIdx.x] = value;
}

extern "C" __global__ void sums_scan(accy_t* scanned, const accy_t* block_sums, unsigned m) {
    __shared__ accy_t warp_totals[32];
    __shared__ accy_t carry_out;
    accy_t carry = (accy_t)0;
    for (unsigned long long start = 0; start < m; start += blockDim.x) {
        const unsigned long long i = start + threadIdx.x;
        accy_t value = i < m ? block_sums[i] : (accy_t)0;
        value = accy_block_inclusive_scan(value, warp_totals) + carry;
        if (i < m) scanned[i] = value;
        if (threadIdx.x == blockDim.x - 1) carry_out = value;
        __syncthreads();
        carry = carry_out;
        __syncthreads();
    }
}

extern "C" __global__ void add_base(accy_t* out, const accy_t* scanned, unsigned n) {
    if (blockIdx.x == 0) return;
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += scanned[blockIdx.x - 1];
}
