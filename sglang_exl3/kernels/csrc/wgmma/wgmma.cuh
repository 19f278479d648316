// The x ring on Hopper's warpgroup MMA (sm_90a builds): blocks of wg_rows(m) = 16-256 rows decode the weights once and
// feed the decoded fragments from registers to wgmma, x from a swizzled shared-memory ring. Launchers per (bits,
// codebook) in their own units (wgmma_instances.cu); they refuse (-1) until exl3_wgmma_available() found the kernels.
#pragma once

#include "../common/group_source.cuh"

namespace exl3 {

extern int g_wgmma;  // exl3_wgmma_available()'s answer (wgmma.cu); -1 before it ran

inline bool wg_mode_ok(int mode) { return mode == EXL3_RING_WGMMA_1 || mode == EXL3_RING_WGMMA_2; }
// rows of x per block (blockIdx.y): the wgmma N, 16 to 256
inline int wg_rows(int m) { return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : m <= 128 ? 128 : 256; }

template <int K2, int CB>
struct Wgmma {
  // partial [splits, m, N] of xh [m, K] @ W_hat (n_tiles % 8 == 0); mode EXL3_RING_WGMMA_1 or _2
  static int partial(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt, int splits,
                     int mode, cudaStream_t stream);
  // a group table's partials (every source's N a multiple of 128)
  static int group(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                   int total_items, int mode, cudaStream_t stream);
  // a group table whose sources all have one K split, m <= 64: y [m, total_cols] rotated inside the launch
  static int group_rotating(const half* xh_all, const GroupSource* srcs, int num, void* out, int out_bf16, int m,
                            int kt, int total_items, int total_cols, cudaStream_t stream);
};

}  // namespace exl3
