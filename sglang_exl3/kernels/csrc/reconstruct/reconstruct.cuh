// W_hat fp16 from the trellis, bit-identical to the codec. Launchers per (bits, codebook) in their own units.
#pragma once

#include "../common/base.cuh"

namespace exl3 {

template <int K2, int CB>
struct Reconstruct {
  // W_hat[:, column tiles tn0 .. tn0 + tn_count) as fp16 [K, ld], from the kernel layout [N/16, K/16, words]
  static int run(const uint32_t* trellis, half* out, int kt, int nt, int tn0, int tn_count, int ld,
                 cudaStream_t stream);
};

}  // namespace exl3
