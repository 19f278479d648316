// The reconstruct kernel (reconstruct.cuh) and its launcher.
#pragma once

#include "../common/decode.cuh"
#include "reconstruct.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

template <int K2, int CB>
__global__ void __launch_bounds__(kWarps * 32) reconstruct_kernel(const uint32_t* __restrict__ trellis,
                                                                  half* __restrict__ out, int k_tiles, int n_tiles,
                                                                  int tn0, int tn_count, int ld) {
  __shared__ __align__(16) half stage[kWarps][16][24];  // rows padded to 48 B (16-byte aligned)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = blockIdx.x * kWarps + warp;
  if (tile >= k_tiles * tn_count) return;
  const int tk = tile / tn_count, tn_rel = tile % tn_count;
  LaneBits<K2> bits(lane);
  uint32_t u[LaneBits<K2>::kLoad], frag[4];
  bits.load(trellis, (uint32_t)((tn0 + tn_rel) * k_tiles + tk) * words32(K2), u);
  bits.template decode<CB>(u, frag);
  const int g = lane >> 2, r = 2 * (lane & 3);
  half(*s)[24] = stage[warp];
  const half2* f = reinterpret_cast<const half2*>(frag);
  s[r][g] = __low2half(f[0]);
  s[r + 1][g] = __high2half(f[0]);
  s[r][g + 8] = __low2half(f[1]);
  s[r + 1][g + 8] = __high2half(f[1]);
  s[r + 8][g] = __low2half(f[2]);
  s[r + 9][g] = __high2half(f[2]);
  s[r + 8][g + 8] = __low2half(f[3]);
  s[r + 9][g + 8] = __high2half(f[3]);
  __syncwarp();
  const int row = lane >> 1, half_col = (lane & 1) * 8;
  const uint4 v = *reinterpret_cast<const uint4*>(&s[row][half_col]);
  *reinterpret_cast<uint4*>(out + (size_t)(tk * 16 + row) * ld + tn_rel * 16 + half_col) = v;
}

}  // namespace

template <int K2, int CB>
int Reconstruct<K2, CB>::run(const uint32_t* trellis, half* out, int kt, int nt, int tn0, int tn_count, int ld,
                             cudaStream_t stream) {
  const int tiles = kt * tn_count;
  reconstruct_kernel<K2, CB><<<(tiles + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(trellis, out, kt, nt, tn0,
                                                                                        tn_count, ld);
  return (int)cudaGetLastError();
}

}  // namespace exl3
