// Single-pass inclusive prefix sum by decoupled look-back (Merrill and Garland, "Single-pass
// Parallel Prefix Scan with Decoupled Look-back", 2016), for 4-byte element types:
//   scan_init:  zero the tile states and the tile counter (one state per tile);
//   scan_tiles: each block takes the next tile from the counter, so a tile's predecessors
//               have all started; it scans its tile, publishes the tile's total, sums the
//               totals (or a finished prefix) of the tiles before it, publishes its own
//               inclusive prefix and writes the tile out. Input is read once, output written
//               once.
//
// A tile is ACCY_VECTORS rows of blockDim.x * 4 elements: in row k, thread t holds the four
// consecutive elements at 4 * (k * blockDim.x + t), loaded and stored as one 16-byte vector
// (so a warp reads 512 contiguous bytes per row). The block scans all rows' thread totals
// at once. A tile's state is one 64-bit word, flag in the high half and the value's bits in
// the low half, so a reader sees flag and value together without a fence.
#include "common.cuh"
#ifndef ACCY_VECTORS
#define ACCY_VECTORS 12
#endif
#ifndef ACCY_STREAMING
#define ACCY_STREAMING 1  // loads and stores marked streaming (evict first from L2): 0 turns it off
#endif
#ifndef ACCY_BACKOFF
#define ACCY_BACKOFF 0  // nanoseconds a look-back lane sleeps between reads of an empty state
#endif
#ifndef ACCY_MIN_BLOCKS
// Blocks per SM the compiler must leave registers for: enough for 768 resident threads, so
// at most 85 registers a thread. At 256 threads that is 3 blocks, which keeps floats at 12
// rows in 80 registers (a few bytes spilled): 7% faster at 1e8-1e9 on the H200 than the 2
// blocks their 105 registers allowed.
#define ACCY_MIN_BLOCKS (768 / ACCY_SCAN_BLOCK > 0 ? 768 / ACCY_SCAN_BLOCK : 1)
#endif
#ifndef ACCY_SCAN_BLOCK
#define ACCY_SCAN_BLOCK 256  // threads of scan_tiles (its launch's blockDim.x)
#endif

// Integers add as unsigned, so they wrap as two's complement without undefined behaviour.
template <typename T> struct accy_scan_traits { typedef T type; };
template <> struct accy_scan_traits<int> { typedef unsigned type; };
typedef accy_scan_traits<accy_t>::type scan_t;

static_assert(sizeof(scan_t) == 4, "the single-pass scan takes 4-byte elements");

__device__ __forceinline__ scan_t accy_from_bits(unsigned bits, float*) { return __uint_as_float(bits); }
__device__ __forceinline__ scan_t accy_from_bits(unsigned bits, unsigned*) { return bits; }
__device__ __forceinline__ unsigned accy_to_bits(float value) { return __float_as_uint(value); }
__device__ __forceinline__ unsigned accy_to_bits(unsigned value) { return value; }
__device__ __forceinline__ scan_t from_bits(unsigned bits) {
    return accy_from_bits(bits, static_cast<scan_t*>(nullptr));
}

#define ACCY_TILE_EMPTY 0ull
#define ACCY_TILE_AGGREGATE 1ull
#define ACCY_TILE_PREFIX 2ull

__device__ __forceinline__ void publish(unsigned long long* state, unsigned long long flag,
                                        scan_t value) {
    const unsigned long long word = (flag << 32) | accy_to_bits(value);
    *reinterpret_cast<volatile unsigned long long*>(state) = word;
}

__device__ __forceinline__ unsigned long long observe(const unsigned long long* state) {
    return *reinterpret_cast<const volatile unsigned long long*>(state);
}

__device__ __forceinline__ uint4 load_row(const uint4* row) {
#if ACCY_STREAMING
    return __ldcs(row);
#else
    return *row;
#endif
}

__device__ __forceinline__ void store_row(uint4* row, uint4 value) {
#if ACCY_STREAMING
    __stcs(row, value);
#else
    *row = value;
#endif
}

__device__ __forceinline__ scan_t warp_inclusive_scan(scan_t value, unsigned lane) {
#pragma unroll
    for (unsigned offset = 1; offset < 32; offset <<= 1) {
        const scan_t other = __shfl_up_sync(0xffffffffu, value, offset);
        if (lane >= offset) value += other;
    }
    return value;
}

__device__ __forceinline__ scan_t warp_sum(scan_t value) {
#pragma unroll
    for (unsigned offset = 16; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    return value;
}

// The sum of the totals of every tile before `tile` (warp 0 only; the result is in every
// lane). Lane j watches tile - 1 - j - 32 * round: the window moves back 32 tiles at a time
// until it meets a tile whose inclusive prefix is published.
__device__ __forceinline__ scan_t look_back(const unsigned long long* states, unsigned tile,
                                            unsigned lane) {
    scan_t exclusive = (scan_t)0;
    long long newest = (long long)tile - 1;
    while (true) {
        const long long index = newest - (long long)lane;
        unsigned long long word = index >= 0 ? observe(states + index) : (ACCY_TILE_PREFIX << 32);
        while (__any_sync(0xffffffffu, (word >> 32) == ACCY_TILE_EMPTY)) {
            if ((word >> 32) == ACCY_TILE_EMPTY) {
#if ACCY_BACKOFF
                __nanosleep(ACCY_BACKOFF);
#endif
                word = observe(states + index);
            }
        }
        const unsigned prefixes = __ballot_sync(0xffffffffu, (word >> 32) == ACCY_TILE_PREFIX);
        const unsigned last = prefixes ? (unsigned)(__ffs(prefixes) - 1) : 31u;
        const scan_t value = lane <= last ? from_bits((unsigned)word) : (scan_t)0;
        exclusive += warp_sum(value);
        if (prefixes) return exclusive;
        newest -= 32;
    }
}

extern "C" __global__ void scan_init(unsigned long long* states, unsigned* counter,
                                     unsigned n) {
    const unsigned tile_elements = ACCY_VECTORS * 4u * ACCY_SCAN_BLOCK;
    const unsigned long long tiles = ((unsigned long long)n + tile_elements - 1) / tile_elements;
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < tiles) states[i] = ACCY_TILE_EMPTY;
    if (i == 0) *counter = 0u;
}

extern "C" __global__ void __launch_bounds__(ACCY_SCAN_BLOCK, ACCY_MIN_BLOCKS)
    scan_tiles(accy_t* out_elements, const accy_t* in_elements,
               unsigned long long* states, unsigned* counter, unsigned n) {
    __shared__ scan_t warp_totals[ACCY_VECTORS][32];
    __shared__ unsigned tile_slot;
    __shared__ scan_t tile_exclusive;
    unsigned* out = reinterpret_cast<unsigned*>(out_elements);
    const unsigned* in = reinterpret_cast<const unsigned*>(in_elements);
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned warps = ACCY_SCAN_BLOCK / 32u;
    const unsigned long long tile_elements = ACCY_VECTORS * 4ull * ACCY_SCAN_BLOCK;

    if (threadIdx.x == 0) tile_slot = atomicAdd(counter, 1u);
    __syncthreads();
    const unsigned tile = tile_slot;
    const unsigned long long base = (unsigned long long)tile * tile_elements;

    // Load: 16-byte vectors when the tile is whole and both arrays are 16-byte aligned.
    scan_t items[ACCY_VECTORS][4];
    const bool vectors = base + tile_elements <= n &&
        ((reinterpret_cast<unsigned long long>(in) | reinterpret_cast<unsigned long long>(out)) &
         15ull) == 0;
    if (vectors) {
        const uint4* in4 = reinterpret_cast<const uint4*>(in + base);
#pragma unroll
        for (unsigned k = 0; k < ACCY_VECTORS; ++k) {
            const uint4 v = load_row(in4 + k * ACCY_SCAN_BLOCK + threadIdx.x);
            items[k][0] = from_bits(v.x);
            items[k][1] = from_bits(v.y);
            items[k][2] = from_bits(v.z);
            items[k][3] = from_bits(v.w);
        }
    } else {  // the last, partial tile (or unaligned arrays): whole vectors where they fit
        const bool aligned = accy_aligned16(in) && accy_aligned16(out);
#pragma unroll
        for (unsigned k = 0; k < ACCY_VECTORS; ++k) {
            const unsigned long long first = base + 4ull * (k * ACCY_SCAN_BLOCK + threadIdx.x);
            if (aligned && first + 4 <= n) {
                const uint4 v = load_row(reinterpret_cast<const uint4*>(in + first));
                items[k][0] = from_bits(v.x);
                items[k][1] = from_bits(v.y);
                items[k][2] = from_bits(v.z);
                items[k][3] = from_bits(v.w);
            } else {
#pragma unroll
                for (unsigned j = 0; j < 4; ++j) {
                    items[k][j] = first + j < n ? from_bits(in[first + j]) : (scan_t)0;
                }
            }
        }
    }

    // Scan each thread's four elements of each row, then every row's thread totals at once.
    scan_t warp_inclusive[ACCY_VECTORS];
#pragma unroll
    for (unsigned k = 0; k < ACCY_VECTORS; ++k) {
        items[k][1] += items[k][0];
        items[k][2] += items[k][1];
        items[k][3] += items[k][2];
        warp_inclusive[k] = warp_inclusive_scan(items[k][3], lane);
        if (lane == 31) warp_totals[k][warp] = warp_inclusive[k];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (unsigned k = 0; k < ACCY_VECTORS; ++k) {
            const scan_t total = lane < warps ? warp_totals[k][lane] : (scan_t)0;
            warp_totals[k][lane] = warp_inclusive_scan(total, lane);
        }
    }
    __syncthreads();
    // Row totals, and the tile's total: what the tile publishes first.
    scan_t row_base[ACCY_VECTORS];
    scan_t aggregate = (scan_t)0;
#pragma unroll
    for (unsigned k = 0; k < ACCY_VECTORS; ++k) {
        row_base[k] = aggregate;
        aggregate += warp_totals[k][warps - 1];
    }

    if (warp == 0) {
        scan_t exclusive = (scan_t)0;
        if (tile == 0) {
            if (lane == 0) publish(states, ACCY_TILE_PREFIX, aggregate);
        } else {
            if (lane == 0) publish(states + tile, ACCY_TILE_AGGREGATE, aggregate);
            exclusive = look_back(states, tile, lane);
            if (lane == 0) publish(states + tile, ACCY_TILE_PREFIX, exclusive + aggregate);
        }
        if (lane == 0) tile_exclusive = exclusive;
    }
    __syncthreads();
    const scan_t tile_base = tile_exclusive;

    // Each element: the tile's base + its row's base + the warps and lanes before it in the row.
#pragma unroll
    for (unsigned k = 0; k < ACCY_VECTORS; ++k) {
        const scan_t before_warp = warp > 0 ? warp_totals[k][warp - 1] : (scan_t)0;
        const scan_t before_thread = warp_inclusive[k] - items[k][3];
        const scan_t offset = tile_base + row_base[k] + before_warp + before_thread;
#pragma unroll
        for (unsigned j = 0; j < 4; ++j) items[k][j] += offset;
    }

    if (vectors) {
        uint4* out4 = reinterpret_cast<uint4*>(out + base);
#pragma unroll
        for (unsigned k = 0; k < ACCY_VECTORS; ++k) {
            store_row(out4 + k * ACCY_SCAN_BLOCK + threadIdx.x,
                      make_uint4(accy_to_bits(items[k][0]), accy_to_bits(items[k][1]),
                                 accy_to_bits(items[k][2]), accy_to_bits(items[k][3])));
        }
    } else {
        const bool aligned = accy_aligned16(in) && accy_aligned16(out);
#pragma unroll
        for (unsigned k = 0; k < ACCY_VECTORS; ++k) {
            const unsigned long long first = base + 4ull * (k * ACCY_SCAN_BLOCK + threadIdx.x);
            if (aligned && first + 4 <= n) {
                store_row(reinterpret_cast<uint4*>(out + first),
                          make_uint4(accy_to_bits(items[k][0]), accy_to_bits(items[k][1]),
                                     accy_to_bits(items[k][2]), accy_to_bits(items[k][3])));
            } else {
#pragma unroll
                for (unsigned j = 0; j < 4; ++j) {
                    if (first + j < n) out[first + j] = accy_to_bits(items[k][j]);
                }
            }
        }
    }
}
