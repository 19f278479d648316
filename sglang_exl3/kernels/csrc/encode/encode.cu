// The plain trellis search kernel (any K) and the search's exports; the fast kernel's variants are encode_instances'.
#include "encode.cuh"

namespace exl3 {
namespace {

__global__ void __launch_bounds__(kEncThreads)
quantize_tiles_kernel(const float* __restrict__ x, const float* __restrict__ table, int* __restrict__ states,
                      float* __restrict__ cost_scratch, uint16_t* __restrict__ back_scratch, int k) {
  const int kr = 16 - k;
  const int edges = 1 << kr;
  const int hi_count = 1 << k;
  const float* xt = x + (size_t)blockIdx.x * 256;
  float* cost0 = cost_scratch + (size_t)blockIdx.x * 2 * edges;
  float* cost1 = cost0 + edges;
  uint16_t* back = back_scratch + (size_t)blockIdx.x * 256 * edges;
  __shared__ float s_val[32];
  __shared__ int s_idx[32];
  __shared__ int s_edge;

  // 256 steps from position `roll`; pre >= 0: the edge every path comes from. Returns the buffer of final costs.
  auto forward = [&](int roll, int pre) -> const float* {
    float* prev = cost0;
    float* cur = cost1;
    for (int i = 0; i < 256; ++i) {
      const int pos = (i + roll) & 255;
      const float xv = xt[pos];
      for (int e = threadIdx.x; e < edges; e += blockDim.x) {
        float best = 0.f;
        int best_in = 0;
        for (int hi = 0; hi < hi_count; ++hi) {
          const int state = (hi << kr) | e;
          const int in_edge = state >> k;
          float err = enc_err(table[state], xv);
          if (i > 0) err = __fadd_rn(err, prev[in_edge]);
          else if (pre >= 0 && in_edge != pre) err = INFINITY;
          if (hi == 0 || err < best) {
            best = err;
            best_in = in_edge;
          }
        }
        cur[e] = best;
        back[(size_t)pos * edges + e] = (uint16_t)best_in;
      }
      __syncthreads();
      float* t = prev;
      prev = cur;
      cur = t;
    }
    return prev;
  };

  // The lowest-index edge of least cost, in every thread.
  auto argmin = [&](const float* cost) -> int {
    const int best_i = block_argmin(cost, edges, s_val, s_idx);
    if (threadIdx.x == 0) s_edge = best_i;
    __syncthreads();
    return s_edge;
  };

  // Walk the backpointers from `edge` at step `last` of a pass from `roll` down to step `first`; returns the edge the
  // path came from before step `first`, in every thread (and writes the states when asked).
  auto backtrack = [&](int roll, int edge, int first, int last, bool write) -> int {
    if (threadIdx.x == 0) {
      for (int j = last; j >= first; --j) {
        const int pos = (j + roll) & 255;
        const int prev = back[(size_t)pos * edges + edge];
        if (write) states[(size_t)blockIdx.x * 256 + pos] = ((prev << k) | edge) & 0xffff;
        edge = prev;
      }
      s_edge = edge;
    }
    __syncthreads();
    return s_edge;
  };

  const int end = argmin(forward(128, -1));
  const int crossing = backtrack(128, end, 128, 255, false);  // steps 128..255 of that pass are positions 0..127
  forward(0, crossing);
  backtrack(0, crossing, 0, 255, true);
}

}  // namespace
}  // namespace exl3

using namespace exl3;

// Calls Encode<K, CB>::fast ARGS for K = 2..8 and the three codebooks (the kernel development build: K = 4 in MCG),
// else returns -1 (unsupported)
#define EXL3_ENCODE_CASE(K, CB, ARGS) \
  case (K) * 4 + (CB): return Encode<K, CB>::fast ARGS;
#define EXL3_ENCODE_CASE3(K, ARGS) EXL3_ENCODE_CASE(K, 0, ARGS) EXL3_ENCODE_CASE(K, 1, ARGS) EXL3_ENCODE_CASE(K, 2, ARGS)
#ifdef EXL3_DEV_4BIT_MCG
#define EXL3_ENCODE_DISPATCH(KV, CBV, ARGS) \
  switch ((KV) * 4 + (CBV)) {               \
    EXL3_ENCODE_CASE(4, 1, ARGS)            \
    default: return -1;                     \
  }
#else
#define EXL3_ENCODE_DISPATCH(KV, CBV, ARGS)                                                                      \
  switch ((KV) * 4 + (CBV)) {                                                                                  \
    EXL3_ENCODE_CASE3(2, ARGS) EXL3_ENCODE_CASE3(3, ARGS) EXL3_ENCODE_CASE3(4, ARGS) EXL3_ENCODE_CASE3(5, ARGS)  \
    EXL3_ENCODE_CASE3(6, ARGS) EXL3_ENCODE_CASE3(7, ARGS) EXL3_ENCODE_CASE3(8, ARGS)                             \
    default: return -1;                                                                                        \
  }
#endif

extern "C" {

// states[t, 256] (int32, position order) of the tail-biting path of least squared error for tiles x[t, 256] (fp32,
// position order) against the codebook values `table` (fp32 [65536]); K in 1..8. Scratch: cost fp32
// [tiles, 2, 2^(16-K)], back uint16 [tiles, 256, 2^(16-K)] (the caller chunks the tiles to bound it).
int exl3_quantize_tiles(const void* x, const void* table, void* states, void* cost_scratch, void* back_scratch,
                        int tiles, int k, void* stream) {
  if (tiles <= 0 || k < 1 || k > 8) return -3;
  const int threads = (1 << (16 - k)) < kEncThreads ? (1 << (16 - k)) : kEncThreads;
  quantize_tiles_kernel<<<tiles, threads, 0, (cudaStream_t)stream>>>(
      (const float*)x, (const float*)table, (int*)states, (float*)cost_scratch, (uint16_t*)back_scratch, k);
  return (int)cudaGetLastError();
}

// The same states as exl3_quantize_tiles for K in 2..8, computed by quantize_tiles_fast_kernel with codebook `cb`
// (0 3INST, 1 MCG, 2 MUL1) on at most `blocks` persistent blocks; snaps: fp32 scratch of
// exl3_quantize_tiles_fast_scratch(k) floats per block. tiles == 0 asks instead: *blocks_out = the blocks resident at
// once on the current device.
int exl3_quantize_tiles_fast(const void* x, void* states, void* snaps, int tiles, int k, int cb, int blocks,
                             int* blocks_out, void* stream) {
  if (tiles < 0 || k < 2 || k > 8 || cb < 0 || cb > 2 || (tiles > 0 && blocks <= 0)) return -3;
  int* b = tiles == 0 ? blocks_out : &blocks;
  if (b == nullptr) return -3;
  const float* xf = (const float*)x;
  cudaStream_t s = (cudaStream_t)stream;
  int* st = (int*)states;
  float* sn = (float*)snaps;
  EXL3_ENCODE_DISPATCH(k, cb, (xf, st, sn, tiles, b, s))
}

long long exl3_quantize_tiles_fast_scratch(int k) {
  switch (k) {
    case 2: return enc_scratch_floats<2>();
    case 3: return enc_scratch_floats<3>();
    case 4: return enc_scratch_floats<4>();
    case 5: return enc_scratch_floats<5>();
    case 6: return enc_scratch_floats<6>();
    case 7: return enc_scratch_floats<7>();
    case 8: return enc_scratch_floats<8>();
    default: return -3;
  }
}

}  // extern "C"
