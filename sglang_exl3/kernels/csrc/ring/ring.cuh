// The x-ring GEMM on mma.sync (any m, 64-row blocks): the same partials as the m <= 64 GEMMs, with x streamed through a
// shared-memory ring instead of staged whole, so the split count no longer depends on m. Launchers per (bits,
// codebook) in their own units (ring_instances.cu).
#pragma once

#include "../common/group_source.cuh"

namespace exl3 {

inline bool ring_mode_ok(int mode) { return mode == EXL3_RING_MMA_1 || mode == EXL3_RING_MMA_2; }

template <int K2, int CB>
struct Ring {
  // partial [splits, m, N] of xh [m, K] @ W_hat (n_tiles % 8 == 0); mode EXL3_RING_MMA_1 or _2
  static int partial(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt, int splits,
                     int mode, cudaStream_t stream);
  // a group table's partials (every source's N a multiple of 128)
  static int group(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                   int total_items, int mode, cudaStream_t stream);
};

}  // namespace exl3
