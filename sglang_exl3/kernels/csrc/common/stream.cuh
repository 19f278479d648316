// The x rings' shared pieces: cp.async copies, the free-standing mma and a lane's stream of trellis words.
#pragma once

#include "decode.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

// ---- the GEMM with x streamed through a shared-memory ring ------------------------------------------------
// gemm_xs_kernel stages a block's whole K slice of x before its first mma, so the slice (rows x K / splits) sets the
// split count: at 64 rows a 48 KB slice takes 12+ splits of 4096 x 14336, and the fp32 partials, the x traffic from
// L2 and the un-overlapped staging grow with m. Here x arrives in chunks of CG trellis groups (CG * kDepth k-tiles)
// through a ring of ring_stages(CG) slots filled by cp.async ahead of use, so the split count is free again and a
// block of KW warps reads each x chunk once for KW column strips. A block stages MT * 8 rows, zero past m. Rows
// beyond 64 are further 64-row blocks (blockIdx.y), each decoding the weights again. Per warp the k order is
// gemm_warp's, so the partials are the same bit for bit at equal splits.
constexpr int kRingMaxRows = 64;

__host__ __device__ constexpr int ring_stages(int cg) { return cg == 1 ? 3 : 2; }
__host__ __device__ constexpr int ring_row_bytes(int cg) { return cg * kDepth * 32 + 16; }  // a chunk row + skew
__host__ __device__ constexpr int ring_smem(int mt, int cg) { return ring_stages(cg) * mt * 8 * ring_row_bytes(cg); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {  // zero-fills past src_bytes
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// mma_16816 without `volatile`: a pure register operation, so the compiler may interleave it with the next tile's
// decode (the ring kernel's ldmatrix stays volatile: it must not move above the barrier that publishes its chunk).
__device__ __forceinline__ void mma_16816_free(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A lane's stream of trellis words down its column strip's K slice (kernel layout [n_tiles, k_tiles, W]: one
// contiguous run per strip): load(buf, count) reads the next `count` tiles' words at LaneBits' indexes into
// buf[0..count) (immediate offsets d * W from one pointer per word) and advances.
template <int K2>
struct TileStream {
  static constexpr int L = LaneBits<K2>::kLoad, W = words32(K2);
  const uint32_t* lw[L];

  __device__ __forceinline__ TileStream(const uint32_t* __restrict__ trellis, const LaneBits<K2>& bits, size_t tile0) {
#pragma unroll
    for (int i = 0; i < L; ++i) lw[i] = trellis + tile0 * W + bits.idx[i];
  }

  template <typename Buf>
  __device__ __forceinline__ void load(Buf& buf, int count) {
#pragma unroll
    for (int d = 0; d < count; ++d) {
#pragma unroll
      for (int i = 0; i < L; ++i) buf[d][i] = __ldg(lw[i] + d * W);
    }
#pragma unroll
    for (int i = 0; i < L; ++i) lw[i] += count * W;
  }
};

}  // namespace
}  // namespace exl3
