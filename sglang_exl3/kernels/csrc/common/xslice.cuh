// The warp GEMM at the heart of the m <= 64 kernels: one warp per (16-column strip, K split) work item, x from global
// memory or staged in shared memory, fp32 split-K partials.
#pragma once

#include "decode.cuh"
#include "launch.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

// ---- fused decode GEMM: partial[split, m, N] = xh[m, K-slice] @ W_hat[K-slice, N] -----------------
// Weights in the kernel layout [N/16, K/16, words] (tiles of one column strip contiguous; see prepare()).

// One warp's work item: column strip tn = item % n_tiles over K split item / n_tiles.
// B fragments of MT 8-row groups for one k16 tile from shared memory: ldmatrix .x2 (MT = 1) or one .x4 per 16
// rows; `addr` is this lane's address of the tile in rows 0-15 (see stage_x), `rows16` the bytes of 16 rows.
template <int MT>
__device__ __forceinline__ void ldsm_b(uint32_t addr, uint32_t rows16, uint32_t (&b)[MT][2]) {
  if constexpr (MT == 1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(b[0][0]), "=r"(b[0][1]) : "r"(addr));
  } else {
#pragma unroll
    for (int g = 0; g < MT / 2; ++g)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(b[2 * g][0]), "=r"(b[2 * g][1]), "=r"(b[2 * g + 1][0]), "=r"(b[2 * g + 1][1])
                   : "r"(addr + g * rows16));
  }
}

// Rows of x staged per block: up to 16 rows, the m rows themselves (ldmatrix rows past m re-read row 0); above 16,
// whole 16-row groups with the rows past m zero (so one address per lane serves every group).
__host__ __device__ constexpr int xs_rows(int m, int mt) { return mt <= 2 ? (m < mt * 8 ? m : mt * 8) : mt * 8; }

// x rows [0, xs_rows) of the K-slice [kt0, kt1) into shared memory, row stride (kt1 - kt0) * 32 + 16 bytes (the
// 16-byte skew keeps ldmatrix's 8 row reads on distinct banks); all threads of the block take part. Returns this
// lane's ldmatrix address for the slice's first tile: row r = lane % 8 (+ 8 for lanes 16..31), k half = lane / 8 % 2;
// up to 16 rows, rows past m read row 0, as the global-memory path does (their C columns are never stored).
template <int MT>
__device__ __forceinline__ uint32_t stage_x(const half* __restrict__ xh, int m, int K, int kt0, int kt1,
                                            uint4* __restrict__ xs) {
  const int rows = xs_rows(m, MT);
  const int row16 = (kt1 - kt0) * 2, stride16 = row16 + 1;  // in 16-byte units
  for (int i = threadIdx.x; i < rows * row16; i += blockDim.x) {
    const int r = i / row16, c = i - r * row16;
    xs[r * stride16 + c] = r < m ? __ldg(reinterpret_cast<const uint4*>(xh + (size_t)r * K + kt0 * 16) + c)
                                 : make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int r = (lane & 7) + (MT >= 2 ? (lane >> 4) * 8 : 0);
  const int row = MT > 2 || r < m ? r : 0;
  return (uint32_t)__cvta_generic_to_shared(xs + row * stride16 + ((lane >> 3) & 1));
}

// stage_x once the launch that wrote x has finished: the x-slice GEMMs' stage callback, called after the warp's first
// weight loads are issued (as a programmatic dependent, launch_plain; a plain launch returns from the wait at once)
template <int MT>
__device__ __forceinline__ uint32_t wait_then_stage_x(const half* __restrict__ xh, int m, int K, int kt0, int kt1,
                                                      uint4* __restrict__ xs) {
  pdl_wait();
  return stage_x<MT>(xh, m, K, kt0, kt1, xs);
}

// A warp's accumulators into its partials: C fragment rows = output features g, g + 8 of the strip, columns = x rows
// 2tq, 2tq + 1 of each 8-row group; rows at or past m are not stored. `out` points at row 0 of the strip.
template <int MT>
__device__ __forceinline__ void store_acc(float* __restrict__ out, const float (&acc)[MT][4], int m, int N, int lane) {
  const int g = lane >> 2, tq = lane & 3;
  out += g;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r0 = mt * 8 + 2 * tq;
    if (r0 < m) {
      out[(size_t)r0 * N] = acc[mt][0];
      out[(size_t)r0 * N + 8] = acc[mt][2];
    }
    if (r0 + 1 < m) {
      out[(size_t)(r0 + 1) * N] = acc[mt][1];
      out[(size_t)(r0 + 1) * N + 8] = acc[mt][3];
    }
  }
}

// With XS, `stage(kt0, kt1)` fills the block's x slice and returns the lane's ldmatrix address (default: stage_x
// from xh); it runs after the first group's trellis loads are issued.
template <int K2, int CB, int MT, int DEPTH, bool XS = false, typename Stage = int>
__device__ __forceinline__ void gemm_warp(const half* __restrict__ xh, const uint32_t* __restrict__ trellis,
                                          float* __restrict__ partial, int m, int k_tiles, int n_tiles, int splits,
                                          int item, uint4* __restrict__ xs = nullptr, Stage stage = 0) {
  constexpr int L = LaneBits<K2>::kLoad;
  const int lane = threadIdx.x & 31;
  const int tn = item % n_tiles, split = item / n_tiles;
  const int kt0 = (int)((long long)split * k_tiles / splits), kt1 = (int)((long long)(split + 1) * k_tiles / splits);
  const int K = k_tiles * 16, N = n_tiles * 16;
  const int g = lane >> 2, tq = lane & 3;
  const LaneBits<K2> bits(lane);
  constexpr int W = words32(K2);
  // Kernel layout [n_tiles, k_tiles, W]: this warp's tiles are one contiguous stream, so the DEPTH tiles of
  // a group sit at immediate offsets d * W from one pointer per loaded word.
  const uint32_t* lw[L];
#pragma unroll
  for (int i = 0; i < L; ++i) lw[i] = trellis + ((size_t)tn * k_tiles + kt0) * W + bits.idx[i];

  // x rows of this lane for each 8-row group (B fragment: row g of the group, k = 2tq + {0,1} + 8{0,1})
  const uint32_t* xp[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int row = mt * 8 + g;
    xp[mt] = reinterpret_cast<const uint32_t*>(xh + (size_t)(row < m ? row : 0) * K + kt0 * 16) + tq;
  }

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

  // For m <= 16 the activation fragments of a group are loaded with its trellis words (they are L2 hits, but
  // loading them next to the mma stalled every tile on their latency); larger m loads them per tile. With XS the
  // block's x slice sits in shared memory and each tile's fragments are one ldmatrix, issued a group at a time.
  constexpr bool kPrefetchX = MT <= 2 && !XS;
  uint32_t xs_addr = 0;
  constexpr int XB = kPrefetchX ? MT : 1;
  auto load_tiles = [&](auto& buf, auto& xb, int count) {  // the next `count` tiles
#pragma unroll
    for (int d = 0; d < count; ++d) {
#pragma unroll
      for (int i = 0; i < L; ++i) buf[d][i] = __ldg(lw[i] + d * W);
      if constexpr (kPrefetchX) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          xb[d][mt][0] = __ldg(xp[mt] + d * 8);  // rows past m read row 0; their C columns are never stored
          xb[d][mt][1] = __ldg(xp[mt] + d * 8 + 4);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < L; ++i) lw[i] += count * W;
    if constexpr (kPrefetchX) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) xp[mt] += count * 8;
    }
  };
  auto compute_tiles = [&](const auto& buf, const auto& xb, int count) {
    if constexpr (XS) {
      constexpr int N = sizeof(buf) / sizeof(buf[0]);
      uint32_t bs[N][MT][2];
      const uint32_t rows16 = 16 * ((kt1 - kt0) * 32 + 16);
#pragma unroll
      for (int d = 0; d < count; ++d) ldsm_b<MT>(xs_addr + d * 32, rows16, bs[d]);
      xs_addr += count * 32;
#pragma unroll
      for (int d = 0; d < count; ++d) {
        uint32_t frag[4];
        bits.template decode<CB>(buf[d], frag);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma_16816(acc[mt], frag, bs[d][mt][0], bs[d][mt][1]);
      }
      return;
    }
#pragma unroll
    for (int d = 0; d < count; ++d) {
      uint32_t b0[MT], b1[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (kPrefetchX) {
          b0[mt] = xb[d][mt][0];
          b1[mt] = xb[d][mt][1];
        } else {
          b0[mt] = __ldg(xp[mt] + d * 8);
          b1[mt] = __ldg(xp[mt] + d * 8 + 4);
        }
      }
      uint32_t frag[4];
      bits.template decode<CB>(buf[d], frag);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_16816(acc[mt], frag, b0[mt], b1[mt]);
    }
    if constexpr (!kPrefetchX) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) xp[mt] += count * 8;
    }
  };

  // Groups of DEPTH tiles, ping-ponged between two register buffers: the next group's loads are issued
  // before the current group is decoded, so DEPTH tiles of latency hide behind the decode work.
  const int groups = (kt1 - kt0) / DEPTH;
  uint32_t buf_a[DEPTH][L], buf_b[DEPTH][L];
  uint32_t xb_a[DEPTH][XB][2], xb_b[DEPTH][XB][2];
  if (groups > 0) load_tiles(buf_a, xb_a, DEPTH);
  if constexpr (XS) {  // while the first group's words are in flight
    if constexpr (std::is_same_v<Stage, int>) xs_addr = stage_x<MT>(xh, m, K, kt0, kt1, xs);
    else xs_addr = stage(kt0, kt1);
  }
  for (int grp = 0; grp < groups; grp += 2) {
    if (grp + 1 < groups) load_tiles(buf_b, xb_b, DEPTH);
    compute_tiles(buf_a, xb_a, DEPTH);
    if (grp + 1 >= groups) break;
    if (grp + 2 < groups) load_tiles(buf_a, xb_a, DEPTH);
    compute_tiles(buf_b, xb_b, DEPTH);
  }
  for (int left = (kt1 - kt0) - groups * DEPTH; left > 0; --left) {  // fewer than DEPTH tiles
    uint32_t one[1][L], xone[1][XB][2];
    load_tiles(one, xone, 1);
    compute_tiles(one, xone, 1);
  }

  store_acc<MT>(partial + (size_t)split * m * N + tn * 16, acc, m, N, lane);
}


// Shared memory of gemm_xs_kernel: min(m, 16) rows of the longest K slice, plus the 16-byte skew per row.
inline int xs_smem_bytes(int m, int kt, int splits) {
  const int slice = (kt + splits - 1) / splits;
  const int mt = m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
  return xs_rows(m, mt) * (slice * 32 + 16);
}

}  // namespace
}  // namespace exl3
