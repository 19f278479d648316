// Rotating x into a block's shared memory slice, and the last-arrival counters with which the one-launch kernels
// finish a column block: shared by the one-launch linear and the MoE decode.
#pragma once

#include "xslice.cuh"
#include "rotation.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

// Rows [0, xs_rows(m, MT)) of the x slice [kt0, kt1) (whole 128-blocks) = had_in(x * suh), laid out as stage_x lays
// them out; rows past m zero (MT > 2) or absent (the ldmatrix addresses of MT <= 2 re-read row 0, as stage_x's do).
// One warp per (row, 128-block) task, kStageBatch tasks' loads in flight before the first is rotated: one at a time,
// a warp with 16-64 tasks (8 rows, 4096-wide K slices) waited out as many L2 latencies in a row. Returns the lane's
// ldmatrix address, as stage_x does.
constexpr int kStageBatch = 8;
template <int MT, typename T>
__device__ __forceinline__ uint32_t stage_x_rotated_rows(const T* __restrict__ x, int m, int K,
                                                         const half* __restrict__ suh, int kt0, int kt1,
                                                         uint4* __restrict__ xs) {
  const int rows = xs_rows(m, MT), blocks = (kt1 - kt0) / 8, stride16 = (kt1 - kt0) * 2 + 1, tasks = rows * blocks;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int i0 = warp; i0 < tasks; i0 += warps * kStageBatch) {
    half v[kStageBatch][4];
    uint2 sv[kStageBatch];
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = i0 + u * warps, r = i / blocks, b = kt0 / 8 + i % blocks;
      if (i < tasks && r < m) {
        load4_fp16(x + (size_t)r * K + b * 128 + lane * 4, v[u]);
        sv[u] = *reinterpret_cast<const uint2*>(suh + b * 128 + lane * 4);
      }
    }
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = i0 + u * warps, r = i / blocks, b = kt0 / 8 + i % blocks;
      if (i >= tasks) break;
      half* dst = reinterpret_cast<half*>(xs + r * stride16) + (b * 8 - kt0) * 16;
      if (r < m) had_in_scaled(v[u], sv[u], dst, lane);
      else *reinterpret_cast<uint2*>(dst + lane * 4) = make_uint2(0u, 0u);
    }
  }
  __syncthreads();
  const int r = (lane & 7) + (MT >= 2 ? (lane >> 4) * 8 : 0);
  const int row = MT > 2 || r < m ? r : 0;
  return (uint32_t)__cvta_generic_to_shared(xs + row * stride16 + ((lane >> 3) & 1));
}

// One block's arrival at a counter that `total` blocks reach; true (in every thread) for the last one, which has
// reset the counter and may read what the others wrote (through L2: __ldcg).
__device__ __forceinline__ bool last_arrival(int* counter, int total, int* flag) {
  __syncthreads();  // every warp's partials are written
  if (threadIdx.x == 0) {
    __threadfence();
    const int done = atomicAdd(counter, 1) == total - 1;
    if (done) *counter = 0;
    *flag = done;
  }
  __syncthreads();
  const bool done = *flag;
  if (done) __threadfence();
  return done;
}

}  // namespace
}  // namespace exl3
