// The wgmma x-ring kernels (wgmma.cuh) and their launchers.
#pragma once

#include "../common/xslice.cuh"
#include "../common/stream.cuh"
#include "../common/group_source.cuh"
#include "../common/rotation.cuh"
#include "wgmma.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

// ---- the x-ring GEMM on Hopper's warpgroup MMA (sm_90a) --------------------------------------------------------
// The ring GEMM at 64 rows spends ~40 of its ~86 warp instructions per tile on 8 mma.sync and 4 ldmatrix, and decodes
// the weights again per 64 rows. Here each warpgroup (4 warps = 4 column strips = 64 output features) issues one
// wgmma per k-tile and 64 rows of x: A = the decoded fragments, straight from registers (the wgmma A fragment of a
// warp's 16 rows is the mma.m16n8k16 A fragment), B = x^T from shared memory; a block of NR rows (16-256) decodes
// the weights once. wgmma is asynchronous: a trellis group's MMAs run while the next group is decoded.
//
// x arrives as in the ring (cp.async chunks of CG trellis groups), laid out as wgmma's K-major 128-byte-swizzled
// canonical layout: per 64 columns of K ("atom"), a row of x is 128 bytes whose 16-byte pieces are permuted by the
// row's low 3 bits (piece kk at kk ^ (row % 8)); rows 128 bytes apart (SBO = 1024 per 8 rows), atoms NR * 128 bytes
// apart; a k16 tile starts 32 bytes into its atom. (The unswizzled layout, 8x8 core matrices of 128 contiguous
// bytes, measured 0.74-0.88x the mma.sync ring at 8-64 rows and 3.8x bf16's time at 2,048; swizzled, 1.1-1.5x the
// ring at 64-256 rows: wgmma-ab.) Four slots; chunk c + 2 is copied while chunk c is read, so the slot being refilled
// was last read two chunks back, which every warp's wgmma has finished (each waits for all but its latest batch).
// Partials as the ring's ([splits, m, N] fp32); they measured equal to the mma.sync ring's bit for bit, but the
// tensor cores' summation order inside a k16 step is not specified, so the tests allow fp32 rounding.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EXL3_HAS_WGMMA 1
#endif

constexpr int kWgStages = 4;
__host__ __device__ constexpr int wg_slot_bytes(int nr, int cg) { return nr * cg * kDepth * 32; }
// + 1 KB to align the ring to the swizzle pattern's 1,024 bytes
__host__ __device__ constexpr int wg_smem(int nr, int cg) { return kWgStages * wg_slot_bytes(nr, cg) + 1024; }

#define EXL3_ACC4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
template <int B, int MT>  // rows 8B .. 8B + 15 of the accumulators
__device__ __forceinline__ void wgmma_n16(float (&d)[MT][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7"
      "}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : EXL3_ACC4(d, B + 0), EXL3_ACC4(d, B + 1)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <int B, int MT>  // rows 8B .. 8B + 31 of the accumulators
__device__ __forceinline__ void wgmma_n32(float (&d)[MT][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : EXL3_ACC4(d, B + 0), EXL3_ACC4(d, B + 1), EXL3_ACC4(d, B + 2), EXL3_ACC4(d, B + 3)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <int B, int MT>  // rows 8B .. 8B + 63 of the accumulators
__device__ __forceinline__ void wgmma_n64(float (&d)[MT][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : EXL3_ACC4(d, B + 0), EXL3_ACC4(d, B + 1), EXL3_ACC4(d, B + 2), EXL3_ACC4(d, B + 3),
        EXL3_ACC4(d, B + 4), EXL3_ACC4(d, B + 5), EXL3_ACC4(d, B + 6), EXL3_ACC4(d, B + 7)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
#undef EXL3_ACC4

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async writes through the generic proxy, wgmma reads through the async proxy
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// keeps the compiler from touching accumulators across the asynchronous MMAs (CUTLASS's warpgroup_fence_operand)
template <int MT>
__device__ __forceinline__ void fence_acc(float (&acc)[MT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(acc[i][j])::"memory");
}

// acc[NR / 8][4] += W^T tile (a: this warp's 16 features) x x^T tile (desc: NR rows at the descriptor's address), as
// 64-row wgmmas (64 rows of x are 8 KB apart in an atom)
template <int NR>
__device__ __forceinline__ void wgmma_rows(float (&acc)[NR / 8][4], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (NR == 16) wgmma_n16<0>(acc, a, desc);
  else if constexpr (NR == 32) wgmma_n32<0>(acc, a, desc);
  else {
    wgmma_n64<0>(acc, a, desc);
    if constexpr (NR >= 128) wgmma_n64<8>(acc, a, desc + (8192 >> 4));
    if constexpr (NR >= 256) {
      wgmma_n64<16>(acc, a, desc + (16384 >> 4));
      wgmma_n64<24>(acc, a, desc + (24576 >> 4));
    }
  }
}

// This thread's share of a chunk's copies: 16-byte piece (kp, r) of the chunk (kp = 8-column K group, r = row) goes to
// atom kp / 8, row r, piece (kp % 8) ^ (r % 8); a warp's 32 pieces (8 rows x 4 K groups) hit 32 distinct banks groups
// four at a time.
template <int NR, int CG>
struct WgFill {
  static constexpr int kPieces = CG * kDepth * 2;   // 16-byte pieces per row of a chunk
  static constexpr int kRowStep = 256 / kPieces;    // rows per pass of the block's 256 threads
  static constexpr int kPasses = (NR * kPieces + 255) / 256;
  const half* src;  // row 0, piece kp, at the split's first tile
  uint32_t dst;     // (kp, r0) inside a slot
  int r0, tile;     // first row, and the k-tile of piece kp inside a chunk

  __device__ __forceinline__ WgFill(const half* __restrict__ xh, int kt0, int i) {  // i: this thread, 0..255
    const int kp = (i >> 3) % kPieces;
    r0 = (i & 7) + 8 * (i / (8 * kPieces));
    tile = kp >> 1;
    src = xh + kt0 * 16 + kp * 8;
    dst = (kp >> 3) * NR * 128 + r0 * 128 + (((kp & 7) ^ (r0 & 7)) << 4);  // kRowStep % 8 == 0: the same swizzle
  }

  // chunk `chunk` (its tiles clipped to `tiles`) into the slot at `slot`; rows >= mb zero-filled (their copies read
  // nothing; the address given is row 0's)
  __device__ __forceinline__ void fill(uint32_t slot, int chunk, int tiles, int mb, int K) const {
    if (chunk * CG * kDepth + tile >= tiles) return;
    const half* p = src + (size_t)chunk * CG * kDepth * 16;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = r0 + i * kRowStep;
      if (r >= NR) break;
      cp_async16(slot + dst + i * kRowStep * 128, r < mb ? p + (size_t)r * K : p, r < mb ? 16 : 0);
    }
  }
};

// One warp's work item (as ring_warp's) for rows [NR blockIdx.y, +NR) of x; the block's 8 warps (two warpgroups)
// share the item's K split (n_tiles % 8 == 0) and the x ring. kStage: the accumulators go to shared memory over the
// ring instead of to the partials, as [NR rows][128 columns] fp32 of the block's 8 strips (the rotating form).
template <int K2, int CB, int NR, int CG, bool kStage = false>
__device__ __forceinline__ void wg_warp(const half* __restrict__ xh, const uint32_t* __restrict__ trellis,
                                        float* __restrict__ partial, int m, int k_tiles, int n_tiles, int splits,
                                        int item, uint4* __restrict__ ring) {
#ifdef EXL3_HAS_WGMMA
  constexpr int L = LaneBits<K2>::kLoad, D = kDepth, S = kWgStages, P = S - 2;
  constexpr uint32_t slot_bytes = wg_slot_bytes(NR, CG), atom_bytes = NR * 128;
  const int lane = threadIdx.x & 31;
  const int tn = item % n_tiles, split = item / n_tiles;
  const int kt0 = (int)((long long)split * k_tiles / splits), kt1 = (int)((long long)(split + 1) * k_tiles / splits);
  const int K = k_tiles * 16, N = n_tiles * 16;
  const int row0 = blockIdx.y * NR, mb = min(m - row0, NR);
  const LaneBits<K2> bits(lane);
  const WgFill<NR, CG> filler(xh + (size_t)row0 * K, kt0, threadIdx.x);

  TileStream<K2> words(trellis, bits, (size_t)tn * k_tiles + kt0);
  auto load_tiles = [&](auto& buf, int count) { words.load(buf, count); };

  const uint32_t ring0 = ((uint32_t)__cvta_generic_to_shared(ring) + 1023u) & ~1023u;
  // descriptor: start address >> 4 (bits 0-13), LBO >> 4 (16-29; unused when swizzled: 1), SBO >> 4 (32-45),
  // 128-byte swizzle (bits 62-63 = 1)
  const uint64_t desc0 = (uint64_t)((ring0 & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) |
                         (1ull << 62);
  float acc[NR / 8][4];
#pragma unroll
  for (int i = 0; i < NR / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  fence_acc<NR / 8>(acc);
  // A trellis group's D tiles are decoded into one of two fragment sets, then MMA'd as one batch (one fence, D
  // wgmmas, one commit); waiting for the batch before it leaves the other set free for the next group's decode, so a
  // batch has a whole group's decode to finish in.
  uint32_t frag_a[D][4], frag_b[D][4];
  auto mma_batch = [&](auto& frag, uint32_t offset, int count) {
    wgmma_fence();
#pragma unroll
    for (int d = 0; d < count; ++d) wgmma_rows<NR>(acc, frag[d], desc0 + ((offset + d * 32) >> 4));
    wgmma_commit();
    wgmma_wait<1>();
  };

  const int tiles = kt1 - kt0, groups = tiles / D, chunks = (tiles + CG * D - 1) / (CG * D);
#pragma unroll
  for (int c = 0; c < P; ++c) {
    if (c < chunks) filler.fill(ring0 + c * slot_bytes, c, tiles, mb, K);
    cp_async_commit();
  }
  auto chunk_start = [&](int c) {
    cp_async_wait<P - 1>();
    fence_proxy_async();
    __syncthreads();
    if (c + P < chunks) filler.fill(ring0 + ((c + P) % S) * slot_bytes, c + P, tiles, mb, K);
    cp_async_commit();
  };
  auto step = [&](int grp, const auto& cur, auto& next, auto& frag) {
    if (grp + 1 < groups) load_tiles(next, D);
#pragma unroll
    for (int d = 0; d < D; ++d) bits.template decode<CB>(cur[d], frag[d]);
    if (grp % CG == 0) chunk_start(grp / CG);
    mma_batch(frag, ((grp / CG) % S) * slot_bytes + (grp % CG) * atom_bytes, D);
  };
  uint32_t buf_a[D][L], buf_b[D][L];
  if (groups > 0) load_tiles(buf_a, D);
  for (int grp = 0; grp < groups; grp += 2) {
    step(grp, buf_a, buf_b, frag_a);
    if (grp + 1 >= groups) break;
    step(grp + 1, buf_b, buf_a, frag_b);
  }
  if (tiles > groups * D) {  // fewer than kDepth tiles after the last group, in the last chunk
    if (groups % CG == 0) chunk_start(groups / CG);
    const uint32_t offset = ((groups / CG) % S) * slot_bytes + (groups % CG) * atom_bytes;
    wgmma_wait<0>();  // both fragment sets free
    for (int d = 0; d < tiles - groups * D; ++d) {
      uint32_t one[1][L];
      load_tiles(one, 1);
      bits.template decode<CB>(one[0], frag_a[0]);
      mma_batch(frag_a, offset + d * 32, 1);
      wgmma_wait<0>();
    }
  }
  wgmma_wait<0>();
  fence_acc<NR / 8>(acc);
  if constexpr (kStage) {
    static_assert(NR * 128 * 4 <= wg_smem(NR, CG) - 1024, "the staged accumulators must fit the ring");
    cp_async_wait<0>();
    __syncthreads();  // every warp's wgmmas have read their last chunk of the ring
    store_acc<NR / 8>(reinterpret_cast<float*>(ring) + (tn % 8) * 16, acc, mb, 128, lane);
  } else {
    store_acc<NR / 8>(partial + ((size_t)split * m + row0) * N + tn * 16, acc, mb, N, lane);
  }
#else
  __trap();  // the launcher checks exl3_wgmma_available() first
#endif
}

template <int K2, int CB, int NR, int CG>
__global__ void __launch_bounds__(256) gemm_wg_kernel(const half* __restrict__ xh, const uint32_t* __restrict__ trellis,
                                                      float* __restrict__ partial, int m, int k_tiles, int n_tiles,
                                                      int splits) {
  extern __shared__ uint4 ring[];
  wg_warp<K2, CB, NR, CG>(xh, trellis, partial, m, k_tiles, n_tiles, splits, blockIdx.x * 8 + (threadIdx.x >> 5),
                          ring);
}

template <int K2, int CB, int NR, int CG>
__global__ void __launch_bounds__(256) gemm_group_wg_kernel(const half* __restrict__ xh_all,
                                                            const GroupSource* __restrict__ srcs, int num,
                                                            float* __restrict__ partial, int m, int k_tiles,
                                                            int total_items) {
  extern __shared__ uint4 ring[];
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * 8 + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  wg_warp<K2, CB, NR, CG>(xh_all + (size_t)s * m * k_tiles * 16, src.tiles, partial + src.partial_base * m, m,
                          k_tiles, src.n_tiles, src.splits, local, ring);
}

// A group through the wgmma ring at one K split per column block, its output rotated inside the launch: each block
// stages its 64 x 128 fp32 accumulators over its ring and rotates them as had_out does (the one split summed onto
// zero, as had_out_values sums), writing y. No partials reach global memory and no output rotation launch follows.
// Every source has one split, so block lb of source s's blocks [item_begin / 8, + n_tiles / 8) is column block lb; an
// empty source's blocks return.
template <int K2, int CB, int NR, int CG>
__global__ void __launch_bounds__(256) gemm_group_wg_rotating_kernel(const half* __restrict__ xh_all,
                                                                     const GroupSource* __restrict__ srcs, int num,
                                                                     void* __restrict__ out, int out_bf16, int m,
                                                                     int k_tiles, int total_cols) {
#ifdef EXL3_HAS_WGMMA
  extern __shared__ uint4 ring[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int s = group_source_of_item(srcs, num, (long long)blockIdx.x * 8);
  const GroupSource& src = srcs[s];
  const int cb = blockIdx.x - (int)(src.item_begin / 8);
  if (src.n_tiles == 0 || cb >= src.n_tiles / 8) return;
  wg_warp<K2, CB, NR, CG, true>(xh_all + (size_t)s * m * k_tiles * 16, src.tiles, nullptr, m, k_tiles, src.n_tiles, 1,
                                cb * 8 + warp, ring);
  __syncthreads();  // every warp's accumulators are staged
  const int row0 = blockIdx.y * NR, mb = min(m - row0, NR);
  const float* staged = reinterpret_cast<const float*>(ring);
  for (int r = warp; r < mb; r += 8) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    const float4 t = *reinterpret_cast<const float4*>(staged + r * 128 + lane * 4);
    v[0] += t.x;
    v[1] += t.y;
    v[2] += t.z;
    v[3] += t.w;
    half op[4];
    had_out_finish(v, src.svh + cb * 128, lane, op);
    const size_t at = (size_t)(row0 + r) * total_cols + src.col_begin + cb * 128 + lane * 4;
    if (out_bf16) store4(reinterpret_cast<__nv_bfloat16*>(out) + at, op);
    else store4(reinterpret_cast<half*>(out) + at, op);
  }
#else
  __trap();  // the launcher checks exl3_wgmma_available() first
#endif
}

constexpr int kMaxWgSmem = 129 << 10;

// wgmma ring kernels: wg_rows(m) rows per block (blockIdx.y); one or two trellis groups per chunk (256 rows: always
// one, which is 128 KB of ring).
template <typename KernelOf, typename... Args>
int launch_wg(int m, int mode, int grid_x, cudaStream_t stream, KernelOf kernel_of, Args... args) {
  if (g_wgmma != 1) return -1;
  const int nr = wg_rows(m);
  const dim3 grid(grid_x, (m + nr - 1) / nr);
  auto go = [&](auto rows, auto cg) -> int {
    constexpr int NR = decltype(rows)::value, CG = decltype(cg)::value, smem = wg_smem(NR, CG);
    static_assert(smem <= kMaxWgSmem, "wgmma ring too large");
    auto kernel = kernel_of(rows, cg);
    if (smem > (48 << 10)) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<grid, 256, smem, stream>>>(args...);
    return (int)cudaGetLastError();
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  auto with_cg = [&](auto rows) -> int { return mode == EXL3_RING_WGMMA_2 ? go(rows, Two{}) : go(rows, One{}); };
  switch (nr) {
    case 16: return with_cg(std::integral_constant<int, 16>{});
    case 32: return with_cg(std::integral_constant<int, 32>{});
    case 64: return with_cg(std::integral_constant<int, 64>{});
    case 128: return with_cg(std::integral_constant<int, 128>{});
    default: return go(std::integral_constant<int, 256>{}, One{});
  }
}

}  // namespace

template <int K2, int CB>
int Wgmma<K2, CB>::partial(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt, int splits,
                           int mode, cudaStream_t stream) {
  if (nt % 8) return -3;
  auto kernel_of = [](auto rows, auto cg) {
    return gemm_wg_kernel<K2, CB, decltype(rows)::value, decltype(cg)::value>;
  };
  return launch_wg(m, mode, nt * splits / 8, stream, kernel_of, xh, trellis, partial, m, kt, nt, splits);
}

template <int K2, int CB>
int Wgmma<K2, CB>::group(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                         int total_items, int mode, cudaStream_t stream) {
  if (total_items % 8) return -3;
  auto kernel_of = [](auto rows, auto cg) {
    return gemm_group_wg_kernel<K2, CB, decltype(rows)::value, decltype(cg)::value>;
  };
  return launch_wg(m, mode, total_items / 8, stream, kernel_of, xh_all, srcs, num, partial, m, kt, total_items);
}

template <int K2, int CB>
int Wgmma<K2, CB>::group_rotating(const half* xh_all, const GroupSource* srcs, int num, void* out, int out_bf16, int m,
                                  int kt, int total_items, int total_cols, cudaStream_t stream) {
  if (g_wgmma != 1) return -1;
  constexpr int NR = 64, CG = 1, smem = wg_smem(NR, CG);
  auto kernel = gemm_group_wg_rotating_kernel<K2, CB, NR, CG>;
  if (smem > (48 << 10)) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<dim3(total_items / 8, (m + NR - 1) / NR), 256, smem, stream>>>(xh_all, srcs, num, out, out_bf16, m, kt,
                                                                         total_cols);
  return (int)cudaGetLastError();
}

}  // namespace exl3
