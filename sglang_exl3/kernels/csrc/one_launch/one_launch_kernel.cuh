// The one-launch linear's kernel (one_launch.cuh) and its launcher.
#pragma once

#include "../common/arrival.cuh"
#include "../common/group_source.cuh"
#include "one_launch.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

// exl3_group_linear's three launches in one: each block rotates its K slice of x (whole 128-blocks; every split of
// every source cuts K into such blocks) into shared memory as stage_x lays it out, runs gemm_warp on it, and the last
// block to finish a (source, 128 columns) sums that column block's partials and rotates them into the output. Same
// roundings and summation orders as the three launches: with the same splits the output is bit-identical. Counters
// (one per 128 output columns of the group) are zero between calls; each is reset by the block that completes it.

// One warp per work item, as gemm_group_xs_kernel's (every source's items a multiple of 8: a block's 8 warps share one
// source, one split and a whole 128-column block, so each column block rotates its split's slice of x once); x and y [m, total_cols] in the model's dtype A (fp16 or bf16). Launched as a programmatic
// dependent (PDL): the first trellis loads are issued before the wait for the kernel that wrote x, and nothing is
// written before it.
constexpr int kOneLaunchWarps = 8;
template <int K2, int CB, int MT, typename A>
__global__ void __launch_bounds__(kOneLaunchWarps * 32) linear_decode_kernel(const A* __restrict__ x,
                                                                             const GroupSource* __restrict__ srcs,
                                                                             int num,
                                                                             float* __restrict__ partial,
                                                                             int* __restrict__ counters,
                                                                             A* __restrict__ out, int m, int k_tiles,
                                                                             int total_items, int total_cols) {
  constexpr int KW = kOneLaunchWarps;
  extern __shared__ uint4 xs[];
  __shared__ int flag;
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * KW + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  const int K = k_tiles * 16, N = src.n_tiles * 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const A* xs_rows0 = x + (size_t)src.x_row * K;
  auto stage = [&](int kt0, int kt1) {
    pdl_wait();
    return stage_x_rotated_rows<MT>(xs_rows0, m, K, src.suh, kt0, kt1, xs);
  };
  float* part = partial + src.partial_base * m;
  gemm_warp<K2, CB, MT, kDepth, true>(nullptr, src.tiles, part, m, k_tiles, src.n_tiles, src.splits, local, xs,
                                      stage);
  const int j = (local % src.n_tiles) / 8, c0 = j * 128;
  if (!last_arrival(counters + src.col_begin / 128 + j, (8 / KW) * src.splits, &flag)) return;
  for (int r = warp; r < m; r += KW) {
    half v[4];
    had_out_values<float, true>(part + (size_t)r * N + c0, (size_t)m * N, src.splits, src.svh + c0, lane, v);
    store4(out + (size_t)r * total_cols + src.col_begin + c0 + lane * 4, v);
  }
}

}  // namespace

template <int K2, int CB>
int OneLaunch<K2, CB>::run(const void* x, int bf16, const GroupSource* srcs, int num, float* partial, int* counters,
                           void* out, int m, int kt, int total_items, int total_cols, int xs_slice, int pdl,
                           cudaStream_t stream) {
  constexpr int warps = kOneLaunchWarps;
  if (m > kOneLaunchMaxRows || total_items % warps) return -3;
  const int smem = xs_smem_bytes(m, xs_slice, 1);
  if (smem > kMaxXsSmem) return -3;
  auto launch = [&](auto* op, auto mt) {
    using A = std::remove_pointer_t<decltype(op)>;
    auto kernel = linear_decode_kernel<K2, CB, decltype(mt)::value, A>;
    allow_smem(kernel, smem);
    return launch_ex(kernel, dim3(total_items / warps), warps, smem, pdl != 0, stream, (const A*)x, srcs, num, partial,
                     counters, op, m, kt, total_items, total_cols);
  };
  auto with_rows = [&](auto* op) {  // one or two 8-row groups (m <= 16)
    return m <= 8 ? launch(op, std::integral_constant<int, 1>{}) : launch(op, std::integral_constant<int, 2>{});
  };
  return bf16 ? with_rows((__nv_bfloat16*)out) : with_rows((half*)out);
}

}  // namespace exl3
