// The fast trellis search kernel (encode.cuh) and its launcher.
#pragma once

#include "../common/decode.cuh"
#include "encode.cuh"

namespace exl3 {
namespace {  // device code: private to each translation unit

// The same search, organised so that it is bound by arithmetic rather than memory (K = 2..8): the codebook values are
// computed in registers (decode_pair, as the GEMMs decode them) instead of read from a 256 KiB table; the costs live in
// shared memory; the first pass keeps no backpointers at all but carries, per state, the in-edge its survivor chose at
// position 0 (the same edge the backtrack of the plain kernel finds); the second pass runs forward once, storing its
// costs at segment starts (kEncSeg steps apart) into a small per-block scratch, then recomputes the segments last to
// first with their branch choices (one byte per state) in shared memory and walks them back. Recomputing from a stored
// cost vector repeats the same fp32 operations, so every choice, and the path, equal the plain kernel's. Blocks are
// persistent (one per SM), so each block reuses its scratch and it stays in L2.
template <int K, int CB>
__global__ void __launch_bounds__(EncShape<K>::threads, 1)
quantize_tiles_fast_kernel(const float* __restrict__ x, int* __restrict__ states, float* __restrict__ snaps, int tiles) {
  using S = EncShape<K>;
  extern __shared__ __align__(16) unsigned char enc_smem[];
  float* cost_a = reinterpret_cast<float*>(enc_smem);
  float* cost_b = cost_a + S::edges;
  uint8_t* hist = reinterpret_cast<uint8_t*>(cost_b + S::edges);
  uint16_t* tag_a = reinterpret_cast<uint16_t*>(hist);  // pass 1 only
  uint16_t* tag_b = tag_a + S::edges;
  __shared__ float xs[256];
  __shared__ float r_val[32];
  __shared__ int r_idx[32];
  __shared__ int r_edge;
  float* snap = snaps + (size_t)blockIdx.x * S::segs * S::edges;

  // One trellis step for this thread's out-edges: prev -> cur costs; `branch(e, hi)` sees each choice.
  auto step = [&](int i, float xv, const float* prev, float* cur, int pre, auto&& branch) {
    for (int j = 0; j < S::per_thread; ++j) {
      const int e = threadIdx.x + j * S::threads;
      float best = 0.f;
      int best_hi = 0;
#pragma unroll 8
      for (int hi = 0; hi < S::his; hi += 2) {
        const uint32_t pair = decode_pair<CB>((uint32_t)((hi << S::kr) | e), (uint32_t)(((hi + 1) << S::kr) | e));
        const float2 v = __half22float2(*reinterpret_cast<const half2*>(&pair));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int in_edge = (((hi + h) << S::kr) | e) >> K;
          float err = enc_err(h ? v.y : v.x, xv);
          if (i > 0) err = __fadd_rn(err, prev[in_edge]);
          else if (pre >= 0 && in_edge != pre) err = INFINITY;
          if ((hi + h) == 0 || err < best) {
            best = err;
            best_hi = hi + h;
          }
        }
      }
      cur[e] = best;
      branch(e, best_hi);
    }
  };

  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) xs[i] = x[(size_t)tile * 256 + i];
    __syncthreads();

    // Pass 1 from position 128: the survivor's in-edge at position 0 rides along as a tag.
    float *prev = cost_a, *cur = cost_b;
    uint16_t *tprev = tag_a, *tcur = tag_b;
    for (int i = 0; i < 256; ++i) {
      step(i, xs[(i + 128) & 255], prev, cur, -1, [&](int e, int hi) {
        const int in_edge = ((hi << S::kr) | e) >> K;
        if (i == 128) tcur[e] = (uint16_t)in_edge;
        else if (i > 128) tcur[e] = tprev[in_edge];
      });
      __syncthreads();
      float* t = prev; prev = cur; cur = t;
      uint16_t* u = tprev; tprev = tcur; tcur = u;
    }
    // The lowest-index edge of least final cost; its tag is the crossing edge.
    {
      const int best_i = block_argmin(prev, S::edges, r_val, r_idx);
      if (threadIdx.x == 0) r_edge = tprev[best_i];
      __syncthreads();
    }
    const int crossing = r_edge;

    // Pass 2 from position 0, every path leaving the crossing edge: forward to the last segment, storing the costs at
    // each segment start, then the segments last to first.
    prev = cost_a; cur = cost_b;
    for (int i = 0; i < (S::segs - 1) * S::seg; ++i) {
      step(i, xs[i], prev, cur, crossing, [](int, int) {});
      __syncthreads();
      float* t = prev; prev = cur; cur = t;
      if ((i + 1) % S::seg == 0)
        for (int e = threadIdx.x; e < S::edges; e += S::threads) snap[((i + 1) / S::seg) * S::edges + e] = prev[e];
    }
    int edge = crossing;  // the path ends on the edge it started from
    for (int sgi = S::segs - 1; sgi >= 0; --sgi) {
      prev = cost_a; cur = cost_b;
      if (sgi > 0) {
        __syncthreads();
        for (int e = threadIdx.x; e < S::edges; e += S::threads) prev[e] = snap[sgi * S::edges + e];
        __syncthreads();
      }
      const int i0 = sgi * S::seg;
      for (int i = i0; i < i0 + S::seg; ++i) {
        uint8_t* row = hist + (size_t)(i - i0) * S::edges;
        step(i, xs[i], prev, cur, crossing, [&](int e, int hi) { row[e] = (uint8_t)hi; });
        __syncthreads();
        float* t = prev; prev = cur; cur = t;
      }
      if (threadIdx.x == 0)
        for (int i = i0 + S::seg - 1; i >= i0; --i) {
          const int state = (hist[(size_t)(i - i0) * S::edges + edge] << S::kr) | edge;
          states[(size_t)tile * 256 + i] = state;
          edge = state >> K;
        }
      __syncthreads();
    }
  }
}

}  // namespace

template <int K, int CB>
int Encode<K, CB>::fast(const float* x, int* states, float* snaps, int tiles, int* blocks, cudaStream_t stream) {
  using S = EncShape<K>;
  auto kernel = quantize_tiles_fast_kernel<K, CB>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::smem);
  if (err != cudaSuccess) return (int)err;
  if (tiles == 0) {
    int device = 0, sms = 0, per_sm = 0;
    if ((err = cudaGetDevice(&device)) != cudaSuccess) return (int)err;
    if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return (int)err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, S::threads, S::smem);
    if (err != cudaSuccess) return (int)err;
    *blocks = sms * (per_sm > 0 ? per_sm : 1);
    return 0;
  }
  kernel<<<tiles < *blocks ? tiles : *blocks, S::threads, S::smem, stream>>>(x, states, snaps, tiles);
  return (int)cudaGetLastError();
}

}  // namespace exl3
