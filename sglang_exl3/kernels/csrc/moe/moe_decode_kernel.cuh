// The MoE decode forward's two kernels (moe_decode.cuh) and their launchers.
#pragma once

#include "../common/arrival.cuh"
#include "../common/group_source.cuh"
#include "../common/moe_common.cuh"
#include "moe_decode.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

template <int K2, int CB, typename T>
__global__ void __launch_bounds__(kWarps * 32) moe_decode_gu_kernel(MoeDecodeArgs a) {
  extern __shared__ uint4 xs[];
  __shared__ uint2 up_vals[32];
  __shared__ int flag;
  pdl_launch_dependents();  // the down launch may be scheduled once every block here has started
  const int S = a.gu_splits, n64 = a.inter / 64;
  int b = blockIdx.x;
  const int split = b % S;
  b /= S;
  const int role = b & 1;
  b >>= 1;
  const int jb = b % n64, p = b / n64;
  const long long e = routed_id(a.ids, a.ids_bytes, p);
  if (e < 0) return;  // the whole block: another rank's expert (weighed 0, never read)
  const GroupSource& src = (role ? a.up : a.gate)[e];
  const int kt = a.hidden / 16, nt = a.inter / 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const T* xrow = reinterpret_cast<const T*>(a.x) + (size_t)(p / a.topk) * a.hidden;
  auto stage = [&](int kt0, int kt1) { return stage_x_rotated_rows<1>(xrow, 1, a.hidden, src.suh, kt0, kt1, xs); };
  gemm_warp<K2, CB, 1, 4, true>(nullptr, src.tiles, a.partial_gu + (size_t)(p * 2 + role) * S * a.inter, 1, kt,
                                     nt, S, split * nt + jb * kWarps + warp, xs, stage);
  const int j = jb >> 1, c0 = j * 128;
  if (!last_arrival(a.counters + (size_t)p * (a.inter / 128) + j, 4 * S, &flag)) return;
  // moe_mid for (p, j): gate's and up's output rotations in warps 0 and 1, then act * up and down's input rotation
  half v[4];
  if (warp < 2) {
    const GroupSource& r = (warp ? a.up : a.gate)[e];
    had_out_values<float, true>(a.partial_gu + ((size_t)(p * 2 + warp) * S) * a.inter + c0, a.inter, S, r.svh + c0,
                                lane, v);
    if (warp == 1) up_vals[lane] = *reinterpret_cast<const uint2*>(v);
  }
  __syncthreads();
  if (warp != 0) return;
  const uint2 uw = up_vals[lane];
  const half* uv = reinterpret_cast<const half*>(&uw);
  half act[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) act[i] = __float2half_rn(moe_act(__half2float(v[i]), a.gelu) * __half2float(uv[i]));
  had_in_values(act, a.down[e].suh + c0, a.xh_dn + (size_t)p * a.inter + c0, lane);
}

// Block (pair p, 64 columns jb of the hidden size, split): grid pairs * (hidden / 64) * dn_splits, kWarps warps.
template <int K2, int CB>
__global__ void __launch_bounds__(kWarps * 32) moe_decode_dn_kernel(MoeDecodeArgs a) {
  extern __shared__ uint4 xs[];
  __shared__ uint2 ys[kMaxFusedTopk][32];
  __shared__ int flag;
  const int S = a.dn_splits, n64 = a.hidden / 64;
  int b = blockIdx.x;
  const int split = b % S;
  b /= S;
  const int jb = b % n64, p = b / n64;
  const long long e = routed_id(a.ids, a.ids_bytes, p);
  const int t = p / a.topk, c0 = (jb >> 1) * 128;
  int valid = 0;
  for (int q = 0; q < a.topk; ++q) valid += routed_id(a.ids, a.ids_bytes, (long long)t * a.topk + q) >= 0;
  if (e < 0) {  // another rank's expert; a token with none of this rank's gets a zero row from its first pair
    if (valid == 0 && p % a.topk == 0 && split == 0 && threadIdx.x < 64) {
      const size_t at = (size_t)t * a.hidden + jb * 64 + threadIdx.x;
      if (a.out_kind == 0) reinterpret_cast<float*>(a.out)[at] = 0.f;
      else if (a.out_kind == 1) reinterpret_cast<half*>(a.out)[at] = __float2half_rn(0.f);
      else reinterpret_cast<__nv_bfloat16*>(a.out)[at] = __float2bfloat16_rn(0.f);
    }
    return;
  }
  const GroupSource& src = a.down[e];
  const int kt = a.inter / 16, nt = a.hidden / 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const half* xrow = a.xh_dn + (size_t)p * a.inter;
  // stage_x's one-row case, but read through L2 (x was written by the launch this one overlaps) and without its
  // per-element row division: this runs on the critical path after the wait
  auto stage = [&](int kt0, int kt1) {  // after the gate/up launch has finished (its first loads are in flight)
    pdl_wait();
    const int row16 = (kt1 - kt0) * 2;
    for (int i = threadIdx.x; i < row16; i += blockDim.x)
      xs[i] = __ldcg(reinterpret_cast<const uint4*>(xrow + kt0 * 16) + i);
    __syncthreads();
    return (uint32_t)__cvta_generic_to_shared(xs + ((lane >> 3) & 1));
  };
  gemm_warp<K2, CB, 1, 4, true>(xrow, src.tiles, a.partial_dn + (size_t)p * S * a.hidden, 1, kt, nt, S,
                                     split * nt + jb * kWarps + warp, xs, stage);
  int* counter = a.counters + (size_t)a.pairs * (a.inter / 128) + (size_t)t * (a.hidden / 128) + (jb >> 1);
  if (!last_arrival(counter, valid * 2 * S, &flag)) return;
  // moe_tail for (t, c0): the top-k rows' output rotations in parallel warps, summed in top-k order by warp 0
  for (int q = warp; q < a.topk; q += kWarps) {
    const long long pq = (long long)t * a.topk + q;
    const long long eq = routed_id(a.ids, a.ids_bytes, pq);
    if (eq < 0) continue;
    half y[4];
    had_out_values<float, true>(a.partial_dn + (size_t)pq * S * a.hidden + c0, a.hidden, S, a.down[eq].svh + c0,
                                lane, y);
    ys[q][lane] = *reinterpret_cast<const uint2*>(y);
  }
  __syncthreads();
  if (warp != 0) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int q = 0; q < a.topk; ++q) {
    const long long pq = (long long)t * a.topk + q;
    if (routed_id(a.ids, a.ids_bytes, pq) < 0) continue;
    const uint2 yw = ys[q][lane];
    const half* y = reinterpret_cast<const half*>(&yw);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += a.w[pq] * __half2float(y[i]);
  }
  const size_t at = (size_t)t * a.hidden + c0 + lane * 4;
  if (a.out_kind == 0) {
    *reinterpret_cast<float4*>(reinterpret_cast<float*>(a.out) + at) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  } else if (a.out_kind == 1) {
    half2* o = reinterpret_cast<half2*>(reinterpret_cast<half*>(a.out) + at);
    o[0] = __floats2half2_rn(acc[0], acc[1]);
    o[1] = __floats2half2_rn(acc[2], acc[3]);
  } else {
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(a.out) + at);
    o[0] = __floats2bfloat162_rn(acc[0], acc[1]);
    o[1] = __floats2bfloat162_rn(acc[2], acc[3]);
  }
}


template <typename Kernel>
int launch_decode(Kernel kernel, int blocks, int slice, bool pdl, cudaStream_t stream, const MoeDecodeArgs& a) {
  const int smem = xs_smem_bytes(1, slice, 1);
  if (smem > kMaxXsSmem) return -3;
  allow_smem(kernel, smem);
  return launch_ex(kernel, dim3(blocks), kWarps, smem, pdl, stream, a);
}

}  // namespace

template <int K2, int CB>
int MoeDecode<K2, CB>::gate_up(const MoeDecodeArgs& a, int x_bf16, cudaStream_t stream) {
  const int blocks = a.pairs * (a.inter / 64) * 2 * a.gu_splits, slice = a.hidden / 16 / a.gu_splits;
  if (x_bf16) return launch_decode(moe_decode_gu_kernel<K2, CB, __nv_bfloat16>, blocks, slice, false, stream, a);
  return launch_decode(moe_decode_gu_kernel<K2, CB, half>, blocks, slice, false, stream, a);
}

template <int K2, int CB>
int MoeDecode<K2, CB>::down(const MoeDecodeArgs& a, int pdl, cudaStream_t stream) {
  const int blocks = a.pairs * (a.hidden / 64) * a.dn_splits, slice = a.inter / 16 / a.dn_splits;
  return launch_decode(moe_decode_dn_kernel<K2, CB>, blocks, slice, pdl != 0, stream, a);
}

}  // namespace exl3
