// The Hadamard-128 rotation kernels in their two forms (one warp, or eight threads, per 128-block), single and
// group; included by hadamard.cu alone.
#pragma once

#include "../common/rotation.cuh"
#include "../common/launch.cuh"
#include "../common/group_source.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

template <typename T>
__global__ void had_in_kernel(const T* __restrict__ x, const half* __restrict__ suh, half* __restrict__ out,
                              int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int blocks = cols / 128;
  if (item >= rows * blocks) return;
  const size_t at = (size_t)(item / blocks) * cols + (item % blocks) * 128;
  had_in_block(x + at, suh + (item % blocks) * 128, out + at, threadIdx.x & 31);
}

// out[r, :] = fp16(fp16(r_scale * H(sum_s acc[s, r, :])) * svh)   (acc fp32 or fp16 [splits, rows, cols]; out fp16,
// or bf16 rounded from that fp16)
template <typename T, typename O>
__global__ void had_out_kernel(const T* __restrict__ acc, const half* __restrict__ svh, O* __restrict__ out,
                               int splits, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int blocks = cols / 128;
  if (item >= rows * blocks) return;
  const int c0 = (item % blocks) * 128;
  const size_t at = (size_t)(item / blocks) * cols + c0;
  had_out_block(acc + at, (size_t)rows * cols, splits, svh + c0, out + at, threadIdx.x & 31);
}

// Group: xh_all[s, r, :] = had_in(x[x_row_s + r, :], suh_s) for every source s
template <typename T>
__global__ void had_in_group_kernel(const T* __restrict__ x, const GroupSource* __restrict__ srcs, int num,
                                    half* __restrict__ xh_all, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int blocks = cols / 128, per_source = rows * blocks;
  if (item >= num * per_source) return;
  const int s = item / per_source, r = (item % per_source) / blocks, c0 = (item % blocks) * 128;
  if (srcs[s].n_tiles == 0) return;  // empty source
  had_in_block(x + (size_t)(srcs[s].x_row + r) * cols + c0, srcs[s].suh + c0,
               xh_all + ((size_t)s * rows + r) * cols + c0, threadIdx.x & 31);
}

// Group: out[r, col_begin_s + c] = had_out of source s's partials, for the concatenated output [rows, total_cols]
// (fp16, or bf16 rounded from it)
template <typename O>
__global__ void had_out_group_kernel(const float* __restrict__ partial, const GroupSource* __restrict__ srcs, int num,
                                     O* __restrict__ out, int rows, int total_cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int blocks = total_cols / 128;
  if (item >= rows * blocks) return;
  const int r = item / blocks, col = (item % blocks) * 128;
  const int s = group_source_at<true>(srcs, num, col);
  const GroupSource& src = srcs[s];
  const int n = src.n_tiles * 16, c0 = col - (int)src.col_begin;
  if (c0 >= n) return;  // an empty source's columns are never read
  const float* acc = partial + src.partial_base * rows + (size_t)r * n + c0;
  had_out_block(acc, (size_t)rows * n, src.splits, src.svh + c0, out + (size_t)r * total_cols + col,
                threadIdx.x & 31);
}

// ---- the rotations at eight threads per 128-block ("octet" form) ---------------------------------------------
// The one-warp form above runs five shuffle stages over 4 values per lane and is ALU-bound at large m (85.6 us for
// had_out at 2048 x 14336, 29 M outputs). Here eight threads of a warp rotate one 128-block: thread t holds the
// 16 consecutive values 16t..16t+15, so strides 1-8 run in registers; strides 16-64 run after one shared-memory
// transpose (thread t then holds columns 2t, 2t+1 of all eight 16-value chunks); a second transpose brings the
// values home for 16-byte stores. Every fp32 operation of butterfly128 runs in the same stage order (lower + upper,
// lower - upper), so the two forms give the same bits.
constexpr int kOctetChunk = 20;                  // floats per 16-value chunk in shared memory: conflict-free float4
constexpr int kOctetStride = 8 * kOctetChunk + 16;  // floats per 128-block: 176 (two blocks in a half-warp differ by 16 banks)
constexpr int kOctetItems = 32;                  // 128-blocks per 256-thread block

// Hadamard-128 (unscaled) of the block held by the octet: v = this thread's 16 consecutive values; sm = the block's
// kOctetStride floats; t = thread within the octet. Every lane of the warp must call it (it syncs the warp).
__device__ __forceinline__ void octet_butterfly(float (&v)[16], float* __restrict__ sm, int t) {
  butterfly_local<16, 1>(v);  // strides 1, 2, 4, 8
  float4* own = reinterpret_cast<float4*>(sm + t * kOctetChunk);
#pragma unroll
  for (int q = 0; q < 4; ++q) own[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
  __syncwarp();
  float a[8], b[8];  // columns 2t and 2t + 1 of chunks 0..7
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    const float2 p = *reinterpret_cast<const float2*>(sm + g * kOctetChunk + 2 * t);
    a[g] = p.x;
    b[g] = p.y;
  }
  butterfly_local<8, 1>(a);  // strides 16, 32, 64
  butterfly_local<8, 1>(b);
  __syncwarp();
#pragma unroll
  for (int g = 0; g < 8; ++g) *reinterpret_cast<float2*>(sm + g * kOctetChunk + 2 * t) = make_float2(a[g], b[g]);
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 p = own[q];
    v[4 * q] = p.x; v[4 * q + 1] = p.y; v[4 * q + 2] = p.z; v[4 * q + 3] = p.w;
  }
}

// had_in of one block by an octet (valid: this octet has a block; others still join the warp's syncs)
template <typename T>
__device__ __forceinline__ void had_in_octet(const T* __restrict__ x, const half* __restrict__ suh,
                                             half* __restrict__ out, bool valid, float* __restrict__ sm, int t) {
  float v[16];
  if (valid) {
    half h[16], s[16];
    load16_fp16(x + 16 * t, h);
    load16_fp16(suh + 16 * t, s);
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = __half2float(__float2half_rn(__half2float(h[i]) * __half2float(s[i])));
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = 0.f;
  }
  octet_butterfly(v, sm, t);
  if (!valid) return;
  half o[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) o[i] = __float2half_rn(v[i] * kRScale);
  store16(out + 16 * t, o);
}

// had_out of one block by an octet: the splits summed in order, rotated, scaled, * svh. fp32 partials are loaded
// two splits at a time; fp16 (one split: reconstruct + cuBLAS) one at a time, which keeps the kernel near 48
// registers, so enough threads are resident to keep the loads of a bandwidth-bound launch in flight
template <typename T, typename O>
__device__ __forceinline__ void had_out_octet(const T* __restrict__ acc, size_t split_stride, int splits,
                                              const half* __restrict__ svh, O* __restrict__ out, bool valid,
                                              float* __restrict__ sm, int t) {
  constexpr int kBatch = std::is_same<T, float>::value ? 2 : 1;
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = 0.f;
  if (valid) {
    const T* p = acc + 16 * t;
    for (int s = 0; s < splits; s += kBatch) {
      float w[kBatch][16];
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (s + j < splits) load16_acc(p + (s + j) * split_stride, w[j]);
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (s + j < splits)
#pragma unroll
          for (int i = 0; i < 16; ++i) v[i] += w[j][i];  // split order, as had_out_values
    }
  }
  octet_butterfly(v, sm, t);
  if (!valid) return;
  half sv[16], o[16];
  load16_fp16(svh + 16 * t, sv);
#pragma unroll
  for (int i = 0; i < 16; ++i)
    o[i] = __float2half_rn(__half2float(__float2half_rn(v[i] * kRScale)) * __half2float(sv[i]));
  store16(out + 16 * t, o);
}

// The octet's block index and thread within it, and its slice of the block's shared memory
struct Octet {
  long long item;
  int t;
  float* sm;
};
__device__ __forceinline__ Octet octet_here() {
  __shared__ __align__(16) float sm_all[kOctetItems * kOctetStride];
  const int o = threadIdx.x >> 3;
  return {(long long)blockIdx.x * kOctetItems + o, (int)(threadIdx.x & 7), sm_all + o * kOctetStride};
}

// Where block `item` of a dense [rows, cols] launch lies: its first column and element offset (0 past the end)
struct OctetBlock {
  bool valid;
  int c0;
  size_t at;
};
__device__ __forceinline__ OctetBlock octet_block(long long item, int rows, int cols) {
  const int blocks = cols / 128;
  if (item >= (long long)rows * blocks) return {false, 0, 0};
  const long long r = item / blocks;
  const int c0 = (int)(item - r * blocks) * 128;
  return {true, c0, (size_t)r * cols + c0};
}

template <typename T>
__global__ void __launch_bounds__(256) had_in_octet_kernel(const T* __restrict__ x, const half* __restrict__ suh,
                                                           half* __restrict__ out, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const Octet o = octet_here();
  const OctetBlock b = octet_block(o.item, rows, cols);
  had_in_octet(x + b.at, suh + b.c0, out + b.at, b.valid, o.sm, o.t);
}

template <typename T, typename O>
__global__ void __launch_bounds__(256) had_out_octet_kernel(const T* __restrict__ acc, const half* __restrict__ svh,
                                                            O* __restrict__ out, int splits, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const Octet o = octet_here();
  const OctetBlock b = octet_block(o.item, rows, cols);
  had_out_octet(acc + b.at, (size_t)rows * cols, splits, svh + b.c0, out + b.at, b.valid, o.sm, o.t);
}

template <typename T>
__global__ void __launch_bounds__(256) had_in_group_octet_kernel(const T* __restrict__ x,
                                                                 const GroupSource* __restrict__ srcs, int num,
                                                                 half* __restrict__ xh_all, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const Octet o = octet_here();
  const OctetBlock b = octet_block(o.item, num * rows, cols);  // xh_all is [num * rows, cols]
  const long long row = (long long)(b.at / cols);
  const int s = (int)(row / rows), r = (int)(row % rows);
  const bool valid = b.valid && srcs[s].n_tiles != 0;  // not an empty source
  had_in_octet(x + (size_t)(valid ? srcs[s].x_row + r : 0) * cols + b.c0, valid ? srcs[s].suh + b.c0 : nullptr,
               xh_all + b.at, valid, o.sm, o.t);
}

template <typename O>
__global__ void __launch_bounds__(256) had_out_group_octet_kernel(const float* __restrict__ partial,
                                                                  const GroupSource* __restrict__ srcs, int num,
                                                                  O* __restrict__ out, int rows, int total_cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const Octet o = octet_here();
  const int blocks = total_cols / 128;
  bool valid = o.item < (long long)rows * blocks;
  const int r = valid ? (int)(o.item / blocks) : 0, col = valid ? (int)(o.item % blocks) * 128 : 0;
  const int s = group_source_at<true>(srcs, num, col);
  const GroupSource& src = srcs[s];
  const int n = src.n_tiles * 16, c0 = col - (int)src.col_begin;
  valid = valid && c0 < n;  // an empty source's columns are never read
  const float* acc = partial + src.partial_base * rows + (size_t)r * n + c0;
  had_out_octet(acc, (size_t)rows * n, src.splits, src.svh + (valid ? c0 : 0),
                out + (size_t)r * total_cols + col, valid, o.sm, o.t);
}

}  // namespace
}  // namespace exl3
