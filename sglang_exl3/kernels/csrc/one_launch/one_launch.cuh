// A dense linear or same-input group in one launch for decode-sized m: each block rotates its K slice of x, runs the
// x-slice GEMM, and the last block of each (source, 128 columns) rotates the output. Launchers per (bits, codebook)
// in their own units (one_launch_instances.cu).
#pragma once

#include "../common/group_source.cuh"

namespace exl3 {

constexpr int kOneLaunchMaxRows = 16;  // one or two 8-row groups; from 16 rows the x ring serves

template <int K2, int CB>
struct OneLaunch {
  // y [m, total_cols] (x's dtype: both fp16 or both bf16) for a group table whose splits cut K into 128-blocks
  static int run(const void* x, int bf16, const GroupSource* srcs, int num, float* partial, int* counters, void* out,
                 int m, int kt, int total_items, int total_cols, int xs_slice, int pdl, cudaStream_t stream);
};

}  // namespace exl3
