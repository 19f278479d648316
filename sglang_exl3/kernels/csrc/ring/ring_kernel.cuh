// The x-ring kernels on mma.sync (ring.cuh) and their launchers.
#pragma once

#include "../common/xslice.cuh"
#include "../common/stream.cuh"
#include "../common/group_source.cuh"
#include "ring.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit


// This thread's share of the block's ring copies: a fixed 16-byte column c of the chunk and rows r0, r0 + step, ..
// (a pass of the block's threads covers `step` rows), so a chunk costs one add and one cp.async per piece.
template <int MT, int CG, int KW>
struct RingFill {
  static constexpr int kPerRow = CG * kDepth * 2;  // 16-byte pieces per row of a chunk
  static constexpr int kStep = KW * 32 / kPerRow;  // rows per pass of the block's threads
  static constexpr int kPasses = (MT * 8 + kStep - 1) / kStep;
  const half* src;  // row 0, column c, at the split's first tile
  uint32_t dst;     // offset of (r0, c) inside a slot
  int r0, tile;     // first row, and the k-tile of column c inside a chunk

  __device__ __forceinline__ RingFill(const half* __restrict__ xh, int kt0) {
    r0 = threadIdx.x / kPerRow;
    const int c = threadIdx.x % kPerRow;
    tile = c >> 1;
    src = xh + kt0 * 16 + c * 8;
    dst = r0 * ring_row_bytes(CG) + c * 16;
  }

  // chunk `chunk` (its tiles clipped to `tiles`, the split's length) into the slot at `slot`; rows >= m zero-filled
  // (their copies read nothing; the address given is row 0's)
  __device__ __forceinline__ void fill(uint32_t slot, int chunk, int tiles, int m, int K) const {
    if (chunk * CG * kDepth + tile >= tiles) return;
    const half* p = src + (size_t)chunk * CG * kDepth * 16;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = r0 + i * kStep;
      if (r >= MT * 8) break;
      cp_async16(slot + dst + i * kStep * ring_row_bytes(CG), r < m ? p + (size_t)r * K : p, r < m ? 16 : 0);
    }
  }
};

// One warp's work item (as gemm_warp's) for rows [64 blockIdx.y, +64) of x; every warp of the block shares the
// item's K split (n_tiles % KW == 0) and takes part in the ring's copies and barriers.
template <int K2, int CB, int MT, int KW, int CG>
__device__ __forceinline__ void ring_warp(const half* __restrict__ xh, const uint32_t* __restrict__ trellis,
                                          float* __restrict__ partial, int m, int k_tiles, int n_tiles, int splits,
                                          int item, uint4* __restrict__ ring) {
  constexpr int L = LaneBits<K2>::kLoad, D = kDepth, S = ring_stages(CG), RB = ring_row_bytes(CG);
  constexpr uint32_t slot_bytes = MT * 8 * RB, rows16 = 16 * RB;
  const int lane = threadIdx.x & 31;
  const int tn = item % n_tiles, split = item / n_tiles;
  const int kt0 = (int)((long long)split * k_tiles / splits), kt1 = (int)((long long)(split + 1) * k_tiles / splits);
  const int K = k_tiles * 16, N = n_tiles * 16;
  const int row0 = blockIdx.y * kRingMaxRows, mb = min(m - row0, kRingMaxRows);  // this block's rows
  const LaneBits<K2> bits(lane);
  const RingFill<MT, CG, KW> filler(xh + (size_t)row0 * K, kt0);

  TileStream<K2> words(trellis, bits, (size_t)tn * k_tiles + kt0);
  auto load_tiles = [&](auto& buf, int count) { words.load(buf, count); };

  // this lane's ldmatrix address in slot 0: row (lane % 8) (+ 8 for lanes 16..31), k half lane / 8 % 2
  const uint32_t ring0 = (uint32_t)__cvta_generic_to_shared(ring);
  const int r = (lane & 7) + (MT >= 2 ? (lane >> 4) * 8 : 0);
  const uint32_t lane_addr = ring0 + r * RB + ((lane >> 3) & 1) * 16;

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  auto compute_tiles = [&](const auto& buf, uint32_t addr, int count) {
    uint32_t b[2][MT][2];
    ldsm_b<MT>(addr, rows16, b[0]);
#pragma unroll
    for (int d = 0; d < count; ++d) {
      if (d + 1 < count) ldsm_b<MT>(addr + (d + 1) * 32, rows16, b[(d + 1) & 1]);
      uint32_t frag[4];
      bits.template decode<CB>(buf[d], frag);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_16816_free(acc[mt], frag, b[d & 1][mt][0], b[d & 1][mt][1]);
    }
  };

  const int tiles = kt1 - kt0, groups = tiles / D, chunks = (tiles + CG * D - 1) / (CG * D);
#pragma unroll
  for (int c = 0; c < S - 1; ++c) {
    if (c < chunks) filler.fill(ring0 + c * slot_bytes, c, tiles, mb, K);
    cp_async_commit();
  }
  // a chunk's first group waits for its x and refills the slot the previous chunk used; every group prefetches the
  // next group's trellis words, then computes
  auto chunk_start = [&](int c) {
    cp_async_wait<S - 2>();
    __syncthreads();
    if (c + S - 1 < chunks) filler.fill(ring0 + ((c + S - 1) % S) * slot_bytes, c + S - 1, tiles, mb, K);
    cp_async_commit();
  };
  auto step = [&](int grp, const auto& cur, auto& next) {
    if (grp % CG == 0) chunk_start(grp / CG);
    if (grp + 1 < groups) load_tiles(next, D);
    compute_tiles(cur, lane_addr + ((grp / CG) % S) * slot_bytes + (grp % CG) * D * 32, D);
  };
  uint32_t buf_a[D][L], buf_b[D][L];
  if (groups > 0) load_tiles(buf_a, D);
  for (int grp = 0; grp < groups; grp += 2) {
    step(grp, buf_a, buf_b);
    if (grp + 1 >= groups) break;
    step(grp + 1, buf_b, buf_a);
  }
  if (tiles > groups * D) {  // fewer than kDepth tiles after the last group, in the last chunk
    if (groups % CG == 0) {
      cp_async_wait<0>();
      __syncthreads();
    }
    const uint32_t addr = lane_addr + ((groups / CG) % S) * slot_bytes + (groups % CG) * D * 32;
    for (int d = 0; d < tiles - groups * D; ++d) {
      uint32_t one[1][L];
      load_tiles(one, 1);
      compute_tiles(one, addr + d * 32, 1);
    }
  }
  store_acc<MT>(partial + ((size_t)split * m + row0) * N + tn * 16, acc, mb, N, lane);
}

template <int K2, int CB, int MT, int KW, int CG>
__global__ void __launch_bounds__(KW * 32) gemm_ring_kernel(const half* __restrict__ xh,
                                                           const uint32_t* __restrict__ trellis,
                                                           float* __restrict__ partial, int m, int k_tiles,
                                                           int n_tiles, int splits) {
  extern __shared__ uint4 ring[];
  ring_warp<K2, CB, MT, KW, CG>(xh, trellis, partial, m, k_tiles, n_tiles, splits,
                                blockIdx.x * KW + (threadIdx.x >> 5), ring);
}

// The same through the x ring (any m, 64-row blocks). Every source's items are a multiple of KW (n_tiles % KW == 0),
// so a block's warps share one source and one K split, as in gemm_group_xs_kernel.
template <int K2, int CB, int MT, int KW, int CG>
__global__ void __launch_bounds__(KW * 32) gemm_group_ring_kernel(const half* __restrict__ xh_all,
                                                                 const GroupSource* __restrict__ srcs, int num,
                                                                 float* __restrict__ partial, int m, int k_tiles,
                                                                 int total_items) {
  extern __shared__ uint4 ring[];
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * KW + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  ring_warp<K2, CB, MT, KW, CG>(xh_all + (size_t)s * m * k_tiles * 16, src.tiles, partial + src.partial_base * m, m,
                                k_tiles, src.n_tiles, src.splits, local, ring);
}

// Launches kernel_of(row groups, warps per block, chunk groups) over grid_x blocks per 64-row block of x, with the
// ring's shared memory (at 64 rows: 27 KB with one group per chunk, 35 KB with two). Blocks of 8 warps: 4-warp blocks
// measured no faster anywhere the dispatch uses the ring (ring-ab-h200).
template <typename KernelOf, typename... Args>
int launch_ring(int m, int mode, int grid_x, cudaStream_t stream, KernelOf kernel_of, Args... args) {
  const dim3 grid(grid_x, (m + kRingMaxRows - 1) / kRingMaxRows);
  return with_row_groups(m < kRingMaxRows ? m : kRingMaxRows, [&](auto mt) {
    constexpr int MT = decltype(mt)::value;
    using W8 = std::integral_constant<int, 8>;
    if (mode == EXL3_RING_MMA_1)
      kernel_of(mt, W8{}, std::integral_constant<int, 1>{})<<<grid, 8 * 32, ring_smem(MT, 1), stream>>>(args...);
    else
      kernel_of(mt, W8{}, std::integral_constant<int, 2>{})<<<grid, 8 * 32, ring_smem(MT, 2), stream>>>(args...);
  });
}

}  // namespace

template <int K2, int CB>
int Ring<K2, CB>::partial(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt, int splits,
                          int mode, cudaStream_t stream) {
  if (nt % 8) return -3;
  auto kernel_of = [](auto mt, auto kw, auto cg) {
    return gemm_ring_kernel<K2, CB, decltype(mt)::value, decltype(kw)::value, decltype(cg)::value>;
  };
  return launch_ring(m, mode, nt * splits / 8, stream, kernel_of, xh, trellis, partial, m, kt, nt, splits);
}

template <int K2, int CB>
int Ring<K2, CB>::group(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                        int total_items, int mode, cudaStream_t stream) {
  if (total_items % 8) return -3;
  auto kernel_of = [](auto mt, auto kw, auto cg) {
    return gemm_group_ring_kernel<K2, CB, decltype(mt)::value, decltype(kw)::value, decltype(cg)::value>;
  };
  return launch_ring(m, mode, total_items / 8, stream, kernel_of, xh_all, srcs, num, partial, m, kt, total_items);
}

}  // namespace exl3
