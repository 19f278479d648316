// The m <= 64 decode GEMM kernels (gemm.cuh) and their launchers.
#pragma once

#include "../common/xslice.cuh"
#include "../common/group_source.cuh"
#include "gemm.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

template <int K2, int CB, int MT, int DEPTH>
__global__ void __launch_bounds__(kWarps * 32) gemm_kernel(const half* __restrict__ xh,
                                                           const uint32_t* __restrict__ trellis,
                                                           float* __restrict__ partial, int m, int k_tiles,
                                                           int n_tiles, int splits) {
  const int item = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (item < n_tiles * splits) gemm_warp<K2, CB, MT, DEPTH>(xh, trellis, partial, m, k_tiles, n_tiles, splits, item);
}

// The same with the block's x slice staged in shared memory (m <= 64; the host guarantees n_tiles % kWarps == 0, so
// the block's warps share one K split and all of them reach stage_x's barrier).
template <int K2, int CB, int MT, int DEPTH>
__global__ void __launch_bounds__(kWarps * 32) gemm_xs_kernel(const half* __restrict__ xh,
                                                              const uint32_t* __restrict__ trellis,
                                                              float* __restrict__ partial, int m, int k_tiles,
                                                              int n_tiles, int splits) {
  extern __shared__ uint4 xs[];
  const int item = blockIdx.x * kWarps + (threadIdx.x >> 5);
  auto stage = [&](int kt0, int kt1) { return wait_then_stage_x<MT>(xh, m, k_tiles * 16, kt0, kt1, xs); };
  gemm_warp<K2, CB, MT, DEPTH, true>(xh, trellis, partial, m, k_tiles, n_tiles, splits, item, xs, stage);
}

template <int K2, int CB, int MT, int DEPTH>
__global__ void __launch_bounds__(kWarps * 32) gemm_group_kernel(const half* __restrict__ xh_all,
                                                                 const GroupSource* __restrict__ srcs, int num,
                                                                 float* __restrict__ partial, int m, int k_tiles,
                                                                 int total_items) {
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * kWarps + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  gemm_warp<K2, CB, MT, DEPTH>(xh_all + (size_t)s * m * k_tiles * 16, src.tiles, partial + src.partial_base * m, m,
                               k_tiles, src.n_tiles, src.splits, local);
}

// The same with each block's x slice in shared memory (m <= 64). Every source's items are a multiple of kWarps
// (N % 128 == 0), so a block's warps share one source and one K split, and are all valid or all idle: the whole
// block returns together or reaches stage_x's barrier together.
template <int K2, int CB, int MT, int DEPTH>
__global__ void __launch_bounds__(kWarps * 32) gemm_group_xs_kernel(const half* __restrict__ xh_all,
                                                                    const GroupSource* __restrict__ srcs, int num,
                                                                    float* __restrict__ partial, int m, int k_tiles,
                                                                    int total_items) {
  extern __shared__ uint4 xs[];
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * kWarps + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  const half* xh = xh_all + (size_t)s * m * k_tiles * 16;
  auto stage = [&](int kt0, int kt1) { return wait_then_stage_x<MT>(xh, m, k_tiles * 16, kt0, kt1, xs); };
  gemm_warp<K2, CB, MT, DEPTH, true>(xh, src.tiles, partial + src.partial_base * m, m, k_tiles, src.n_tiles,
                                     src.splits, local, xs, stage);
}

}  // namespace

template <int K2, int CB>
int Gemm<K2, CB>::partial(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt, int splits,
                          cudaStream_t stream) {
  const dim3 grid((nt * splits + kWarps - 1) / kWarps), block(kWarps * 32);
  return with_row_groups(m, [&](auto mt) {
    gemm_kernel<K2, CB, decltype(mt)::value, kDepth><<<grid, block, 0, stream>>>(xh, trellis, partial, m, kt, nt,
                                                                                 splits);
  });
}

template <int K2, int CB>
int Gemm<K2, CB>::partial_xs(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt,
                             int splits, cudaStream_t stream) {
  if (m > 64 || nt % kWarps) return -3;
  auto kernel_of = [](auto mt) { return gemm_xs_kernel<K2, CB, decltype(mt)::value, kDepth>; };
  return launch_with_smem(m, xs_smem_bytes(m, kt, splits), dim3(nt * splits / kWarps), stream, kernel_of, xh, trellis,
                          partial, m, kt, nt, splits);
}

template <int K2, int CB>
int Gemm<K2, CB>::group(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                        int total_items, cudaStream_t stream) {
  const dim3 grid((total_items + kWarps - 1) / kWarps), block(kWarps * 32);
  return with_row_groups(m, [&](auto mt) {
    gemm_group_kernel<K2, CB, decltype(mt)::value, kDepth><<<grid, block, 0, stream>>>(xh_all, srcs, num, partial, m,
                                                                                       kt, total_items);
  });
}

template <int K2, int CB>
int Gemm<K2, CB>::group_xs(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                           int total_items, int xs_slice, cudaStream_t stream) {
  if (m > 64 || total_items % kWarps) return -3;
  auto kernel_of = [](auto mt) { return gemm_group_xs_kernel<K2, CB, decltype(mt)::value, kDepth>; };
  return launch_with_smem(m, xs_smem_bytes(m, xs_slice, 1), dim3(total_items / kWarps), stream, kernel_of, xh_all,
                          srcs, num, partial, m, kt, total_items);
}

}  // namespace exl3
