// The m <= 64 decode GEMMs: fp32 split-K partials of rotated x @ W_hat, x read from global memory or staged in shared
// memory per block, for a single linear or a group table. Launchers per (bits, codebook), built in their own units
// (gemm_instances.cu).
#pragma once

#include "../common/group_source.cuh"

namespace exl3 {

template <int K2, int CB>
struct Gemm {
  // partial [splits, m, N] of xh [m, K] @ W_hat, x read from global memory (m <= 64)
  static int partial(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt, int splits,
                     cudaStream_t stream);
  // the same partials with the block's K slice of x staged in shared memory (n_tiles % 4 == 0)
  static int partial_xs(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt, int splits,
                        cudaStream_t stream);
  // a group table's partials (every source at its own splits), x from global memory
  static int group(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                   int total_items, cudaStream_t stream);
  // the same with x slices of up to xs_slice tiles in shared memory
  static int group_xs(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                      int total_items, int xs_slice, cudaStream_t stream);
};

}  // namespace exl3
