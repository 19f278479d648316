// Hadamard-128 rotations as device functions (fp32 butterflies in exllamav3's stage order: bit-exact had_r_128),
// used by the rotation kernels and by the kernels that fold a rotation in.
#pragma once

#include "base.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

template <int N, int S>
__device__ __forceinline__ void butterfly_local(float (&v)[N]) {  // strides S, 2S, .. < N over v[0..N)
#pragma unroll
  for (int s = S; s < N; s <<= 1)
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (!(i & s)) {
        const float a = v[i], b = v[i + s];
        v[i] = a + b;
        v[i + s] = a - b;
      }
}

__device__ __forceinline__ void butterfly128(float (&v)[4], int lane) {
  float a = v[0], b = v[1], c = v[2], d = v[3];
  v[0] = a + b; v[1] = a - b; v[2] = c + d; v[3] = c - d;         // stride 1
  a = v[0]; b = v[1]; c = v[2]; d = v[3];
  v[0] = a + c; v[1] = b + d; v[2] = a - c; v[3] = b - d;         // stride 2
#pragma unroll
  for (int s = 1; s < 32; s <<= 1) {                               // strides 4 .. 64
    const bool upper = lane & s;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float p = __shfl_xor_sync(0xffffffffu, v[i], s);
      v[i] = upper ? p - v[i] : v[i] + p;
    }
  }
}

// fp16(r_scale * H(fp16(x * suh))) of one 128-block held in registers (lane: 4 consecutive elements of x and of
// suh, the latter as loaded: sv)
__device__ __forceinline__ void had_in_scaled(const half (&xp)[4], uint2 sv, half* __restrict__ out, int lane) {
  const half* sp = reinterpret_cast<const half*>(&sv);
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __half2float(__float2half_rn(__half2float(xp[i]) * __half2float(sp[i])));
  butterfly128(v, lane);
  uint2 o;
  half* op = reinterpret_cast<half*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) op[i] = __float2half_rn(v[i] * kRScale);
  *reinterpret_cast<uint2*>(out + lane * 4) = o;
}
__device__ __forceinline__ void had_in_values(const half (&xp)[4], const half* __restrict__ suh,
                                              half* __restrict__ out, int lane) {
  had_in_scaled(xp, *reinterpret_cast<const uint2*>(suh + lane * 4), out, lane);
}

// 4 consecutive inputs as fp16: bf16 is rounded to fp16 first, exactly what casting x to fp16 beforehand does
__device__ __forceinline__ void load4_fp16(const half* __restrict__ x, half (&v)[4]) {
  const uint2 xv = *reinterpret_cast<const uint2*>(x);
  const half* xp = reinterpret_cast<const half*>(&xv);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = xp[i];
}
__device__ __forceinline__ void load4_fp16(const __nv_bfloat16* __restrict__ x, half (&v)[4]) {
  const uint2 xv = *reinterpret_cast<const uint2*>(x);
  const __nv_bfloat16* xp = reinterpret_cast<const __nv_bfloat16*>(&xv);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __float2half_rn(__bfloat162float(xp[i]));
}

template <typename T>
__device__ __forceinline__ void had_in_block(const T* __restrict__ x, const half* __restrict__ suh,
                                             half* __restrict__ out, int lane) {
  half v[4];
  load4_fp16(x + lane * 4, v);
  had_in_values(v, suh, out, lane);
}

// fp16(fp16(r_scale * H(sum_s acc[s])) * svh) of one 128-block into registers (lane: 4 consecutive elements);
// acc points at split 0, splits split_stride apart
template <bool kCG, typename T>
__device__ __forceinline__ float load_acc(const T* p) {
  if constexpr (kCG) return __ldcg(p);  // fp32 only: written by another block of this launch, read past L1
  else return (float)*p;
}

// fp16(fp16(r_scale * H(v)) * svh) of one 128-block whose split sum v the lane holds (4 consecutive elements)
__device__ __forceinline__ void had_out_finish(float (&v)[4], const half* __restrict__ svh, int lane, half (&op)[4]) {
  butterfly128(v, lane);
  const uint2 sv = *reinterpret_cast<const uint2*>(svh + lane * 4);
  const half* sp = reinterpret_cast<const half*>(&sv);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    op[i] = __float2half_rn(__half2float(__float2half_rn(v[i] * kRScale)) * __half2float(sp[i]));
}

template <typename T, bool kCG = false>
__device__ __forceinline__ void had_out_values(const T* __restrict__ acc, size_t split_stride, int splits,
                                               const half* __restrict__ svh, int lane, half (&op)[4]) {
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  const T* p = acc + lane * 4;
  int s = 0;
  for (; s + 8 <= splits; s += 8) {  // eight loads in flight: a serial chain of L2 latencies cost up to 16 us
    float t[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) t[j][i] = load_acc<kCG>(p + (s + j) * split_stride + i);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] += t[j][i];  // same order as one split at a time: deterministic
  }
  if (s < splits) {  // the last (< 8) splits: every load issued before the first add, summed in the same order
    float t[7][4];
#pragma unroll
    for (int j = 0; j < 7; ++j)
      if (s + j < splits)
#pragma unroll
        for (int i = 0; i < 4; ++i) t[j][i] = load_acc<kCG>(p + (s + j) * split_stride + i);
#pragma unroll
    for (int j = 0; j < 7; ++j)
      if (s + j < splits)
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] += t[j][i];
  }
  had_out_finish(v, svh, lane, op);
}

// 4 consecutive fp16 outputs stored as fp16, or rounded to bf16: exactly what casting the fp16 output afterwards does
__device__ __forceinline__ void store4(half* __restrict__ out, const half (&v)[4]) {
  *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(v);
}
__device__ __forceinline__ void store4(__nv_bfloat16* __restrict__ out, const half (&v)[4]) {
  uint2 o;
  __nv_bfloat16* op = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) op[i] = __float2bfloat16_rn(__half2float(v[i]));
  *reinterpret_cast<uint2*>(out) = o;
}

template <typename T, typename O>
__device__ __forceinline__ void had_out_block(const T* __restrict__ acc, size_t split_stride, int splits,
                                              const half* __restrict__ svh, O* __restrict__ out, int lane) {
  half op[4];
  had_out_values(acc, split_stride, splits, svh, lane, op);
  store4(out + lane * 4, op);
}

// 16 consecutive fp16 values (bf16 rounded to fp16 as read, as load4_fp16 does), as floats
__device__ __forceinline__ void load16_fp16(const half* __restrict__ x, half (&h)[16]) {
  const uint4* p = reinterpret_cast<const uint4*>(x);
  *reinterpret_cast<uint4*>(&h[0]) = p[0];
  *reinterpret_cast<uint4*>(&h[8]) = p[1];
}
__device__ __forceinline__ void load16_fp16(const __nv_bfloat16* __restrict__ x, half (&h)[16]) {
  const uint4* p = reinterpret_cast<const uint4*>(x);
  uint4 raw[2] = {p[0], p[1]};
  const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) h[i] = __float2half_rn(__bfloat162float(b[i]));
}

// 16 consecutive partial values of one split, as floats (fp32 partials of this launch's GEMM: read past L1)
__device__ __forceinline__ void load16_acc(const float* __restrict__ p, float (&t)[16]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 w = __ldcg(reinterpret_cast<const float4*>(p) + q);
    t[4 * q] = w.x; t[4 * q + 1] = w.y; t[4 * q + 2] = w.z; t[4 * q + 3] = w.w;
  }
}
__device__ __forceinline__ void load16_acc(const half* __restrict__ p, float (&t)[16]) {
  half h[16];
  load16_fp16(p, h);
#pragma unroll
  for (int i = 0; i < 16; ++i) t[i] = __half2float(h[i]);
}

__device__ __forceinline__ void store16(half* __restrict__ out, const half (&h)[16]) {
  uint4* p = reinterpret_cast<uint4*>(out);
  p[0] = *reinterpret_cast<const uint4*>(&h[0]);
  p[1] = *reinterpret_cast<const uint4*>(&h[8]);
}
__device__ __forceinline__ void store16(__nv_bfloat16* __restrict__ out, const half (&h)[16]) {
  uint4 raw[2];
  __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) b[i] = __float2bfloat16_rn(__half2float(h[i]));
  uint4* p = reinterpret_cast<uint4*>(out);
  p[0] = raw[0];
  p[1] = raw[1];
}

}  // namespace
}  // namespace exl3
