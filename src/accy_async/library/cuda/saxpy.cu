// out = a * x + y, element-wise.
#include "common.cuh"

extern "C" __global__ void saxpy(accy_t* out, const accy_t* x, const accy_t* y, unsigned n,
                                 accy_t a) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + y[i];
}
