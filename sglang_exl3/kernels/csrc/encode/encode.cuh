// The trellis search on the GPU (codec/encode.py's tail-biting Viterbi, bit for bit the same path): the plain kernel
// for any K (encode.cu) and the fast kernel for K = 2..8, whose launchers per (K, codebook) are built in their own
// units (encode_instances.cu).
#pragma once

#include "../common/base.cuh"

namespace exl3 {
namespace {  // device code: private to each translation unit

constexpr int kEncThreads = 1024;

__device__ __forceinline__ float enc_err(float value, float x) {
  const float d = __fsub_rn(value, x);
  return __fmul_rn(d, d);
}

__device__ __forceinline__ bool enc_better(float v, int i, float best, int best_i) {
  return v < best || (v == best && i < best_i);
}

// The lowest index of least cost among cost[0, n), by the encoders' tie rule, reduced over the block; the result is
// valid in thread 0 only. s_val / s_idx: one shared slot per warp. Ends after a barrier that its callers' next
// barrier orders against.
__device__ __forceinline__ int block_argmin(const float* cost, int n, float* s_val, int* s_idx) {
  float best = INFINITY;
  int best_i = 1 << 30;
  for (int e = threadIdx.x; e < n; e += blockDim.x)
    if (enc_better(cost[e], e, best, best_i)) {
      best = cost[e];
      best_i = e;
    }
  for (int off = 16; off > 0; off >>= 1) {
    const float v = __shfl_down_sync(0xffffffffu, best, off);
    const int i = __shfl_down_sync(0xffffffffu, best_i, off);
    if (enc_better(v, i, best, best_i)) {
      best = v;
      best_i = i;
    }
  }
  if ((threadIdx.x & 31) == 0) {
    s_val[threadIdx.x >> 5] = best;
    s_idx[threadIdx.x >> 5] = best_i;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < (int)(blockDim.x + 31) / 32; ++w)
      if (enc_better(s_val[w], s_idx[w], best, best_i)) {
        best = s_val[w];
        best_i = s_idx[w];
      }
  return best_i;
}

}  // namespace

// The fast kernel's geometry for K bits per weight: threads per block, segments of the second pass, shared memory
template <int K>
struct EncShape {
  static constexpr int kr = 16 - K, edges = 1 << kr, his = 1 << K;
  static constexpr int threads = edges < 512 ? edges : 512;
  static constexpr int per_thread = edges / threads;
  static constexpr int hist_bytes = K == 2 ? 64 * 1024 : 128 * 1024;  // a segment's branch bytes, at most
  static constexpr int seg = hist_bytes / edges < 256 ? hist_bytes / edges : 256;
  static constexpr int segs = 256 / seg;
  static constexpr int branch_bytes = seg * edges > 4 * edges ? seg * edges : 4 * edges;  // or pass 1's two tags
  static constexpr int smem = 2 * edges * 4 + branch_bytes;  // two cost buffers, then the branches
};

template <int K>
constexpr long long enc_scratch_floats() {  // per block: one cost vector per segment start
  return (long long)EncShape<K>::segs * EncShape<K>::edges;
}

template <int K, int CB>
struct Encode {
  // tiles > 0: launch on at most `blocks` persistent blocks; tiles == 0: store in *blocks how many are resident at
  // once on this device (the scratch the caller allocates).
  static int fast(const float* x, int* states, float* snaps, int tiles, int* blocks, cudaStream_t stream);
};

}  // namespace exl3
