// The rotated slab's glue (layers/moe_rotated.py): the rotations and the combine around SGLang's grouped GEMMs on
// the decoded experts.
#include "../common/moe_common.cuh"
#include "../common/rotation.cuh"

namespace exl3 {
namespace {

// ---- rotated-slab MoE glue (layers/moe_rotated.py) ----------------------------------------------------------
// The experts' W_hat decoded once into a slab and SGLang's grouped Triton GEMM on it leave the rotations to the
// pairs: pair p = t * top-k + j has expert e = ids[p] in slab order (below 0: not this rank's; its rows are zero
// and it adds nothing). Every fp16 rounding of had_in / had_out:
//   rot_in: a[p] = had_in(x[t], gate_suh[e]), a[pairs + p] = had_in(x[t], up_suh[e])   (one GEMM runs both)
//   mid:    h[p] = had_in(fp16(act(had_out(c[p], gate_svh[e])) * had_out(c[pairs + p], up_svh[e])), down_suh[e])
//   tail:   out[t] (fp32) = sum over j in top-k order of w[p] * had_out(y[p], down_svh[e])
// At 4,096 rows of a 128-expert top-8 layer these are ~2 million 128-blocks: the warp form's 20 shuffles per block
// (4 elements per lane) made them shuffle-bound, so here 8 lanes hold a block, 16 consecutive elements each:
// strides 1-8 in registers, 16-64 by shuffles within the 8 lanes (12 per block; the same stages in the same
// order, so bit-identical). A warp rotates 4 blocks; every lane joins every shuffle: an octet past the launch's
// blocks rotates zeros and stores nothing, an unrouted pair's octet rotates zeros into its zero rows (rot_in, mid)
// or adds nothing (tail).
constexpr int kSlabPerWarp = 4;  // 128-blocks per warp (8 lanes each)

struct SlabLane {
  long long item;  // this octet's block, counted over the launch
  int t;           // lane within the octet: elements 16t .. 16t + 15 of the block
};
__device__ __forceinline__ SlabLane slab_lane() {
  const int lane = threadIdx.x & 31;
  const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  return {warp * kSlabPerWarp + (lane >> 3), lane & 7};
}
__device__ __forceinline__ void slab_butterfly(float (&v)[16]) {
  butterfly_local<16, 1>(v);  // strides 1, 2, 4, 8
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int s = 1; s < 8; s <<= 1) {  // strides 16, 32, 64: the lanes of the octet
    const bool upper = lane & s;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float p = __shfl_xor_sync(0xffffffffu, v[i], s);
      v[i] = upper ? p - v[i] : v[i] + p;
    }
  }
}
// fp16(r_scale * H(fp16(x * suh))) of an octet's block: x and suh as loaded (16 values each)
__device__ __forceinline__ void slab_had_in(const half (&x)[16], const half (&sv)[16], half (&o)[16]) {
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __half2float(__float2half_rn(__half2float(x[i]) * __half2float(sv[i])));
  slab_butterfly(v);
#pragma unroll
  for (int i = 0; i < 16; ++i) o[i] = __float2half_rn(v[i] * kRScale);
}
// fp16(fp16(r_scale * H(acc)) * svh) of an octet's block of one fp16 split: had_out_values with splits = 1
__device__ __forceinline__ void slab_had_out(const half (&acc)[16], const half (&sv)[16], half (&o)[16]) {
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __half2float(acc[i]);
  slab_butterfly(v);
#pragma unroll
  for (int i = 0; i < 16; ++i)
    o[i] = __float2half_rn(__half2float(__float2half_rn(v[i] * kRScale)) * __half2float(sv[i]));
}
__device__ __forceinline__ void zero16(half (&h)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) h[i] = __float2half_rn(0.f);
}

template <typename T>
__global__ void __launch_bounds__(256) slab_rot_in_kernel(const T* __restrict__ x, const void* ids, int ids_bytes,
                                                          int pairs, int topk, const half* __restrict__ gate_suh,
                                                          const half* __restrict__ up_suh, half* __restrict__ a,
                                                          int k) {
  const SlabLane l = slab_lane();
  const int blocks = k / 128;
  const long long row = l.item / blocks;  // of a: [2 * pairs, k]
  const int c0 = (int)(l.item % blocks) * 128 + 16 * l.t;
  const bool up = row >= pairs;
  const long long p = up ? row - pairs : row;
  const long long e = row < 2LL * pairs ? routed_id(ids, ids_bytes, p) : -1;
  half xv[16], sv[16], o[16];
  if (e >= 0) {
    load16_fp16(x + (p / topk) * k + c0, xv);
    load16_fp16((up ? up_suh : gate_suh) + e * k + c0, sv);
  } else {
    zero16(xv);
    zero16(sv);
  }
  slab_had_in(xv, sv, o);
  if (row < 2LL * pairs) store16(a + row * k + c0, o);  // an unrouted pair's rows: zeros
}

__global__ void __launch_bounds__(256) slab_mid_kernel(const half* __restrict__ c, const void* ids, int ids_bytes,
                                                       int pairs, const half* __restrict__ gate_svh,
                                                       const half* __restrict__ up_svh,
                                                       const half* __restrict__ down_suh, half* __restrict__ h, int n,
                                                       int gelu) {
  const SlabLane l = slab_lane();
  const int blocks = n / 128;
  const long long p = l.item / blocks;
  const int c0 = (int)(l.item % blocks) * 128 + 16 * l.t;
  const long long e = p < pairs ? routed_id(ids, ids_bytes, p) : -1;
  half gc[16], uc[16], gsv[16], usv[16], dsu[16];
  if (e >= 0) {
    load16_fp16(c + p * n + c0, gc);
    load16_fp16(c + (pairs + p) * n + c0, uc);
    load16_fp16(gate_svh + e * n + c0, gsv);
    load16_fp16(up_svh + e * n + c0, usv);
    load16_fp16(down_suh + e * n + c0, dsu);
  } else {
    zero16(gc); zero16(uc); zero16(gsv); zero16(usv); zero16(dsu);
  }
  half g[16], u[16], act[16], o[16];
  slab_had_out(gc, gsv, g);
  slab_had_out(uc, usv, u);
#pragma unroll
  for (int i = 0; i < 16; ++i) act[i] = __float2half_rn(moe_act(__half2float(g[i]), gelu) * __half2float(u[i]));
  slab_had_in(act, dsu, o);
  if (p < pairs) store16(h + p * n + c0, o);  // an unrouted pair's row: zeros
}

__global__ void __launch_bounds__(256) slab_tail_kernel(const half* __restrict__ y, const void* ids, int ids_bytes,
                                                        const float* __restrict__ w,
                                                        const half* __restrict__ down_svh, float* __restrict__ out,
                                                        int tokens, int topk, int hidden) {
  const SlabLane l = slab_lane();
  const int blocks = hidden / 128;
  const long long t = l.item / blocks;
  const int c0 = (int)(l.item % blocks) * 128 + 16 * l.t;
  const bool valid = t < tokens;
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
  for (int j = 0; j < topk; ++j) {  // top-k is uniform over the warp: every lane joins every rotation
    const long long p = t * topk + j;
    const long long e = valid ? routed_id(ids, ids_bytes, p) : -1;
    half yv[16], sv[16], v[16];
    float wj = 0.f;
    if (e >= 0) {
      load16_fp16(y + p * hidden + c0, yv);
      load16_fp16(down_svh + e * hidden + c0, sv);
      wj = w[p];
    } else {
      zero16(yv);
      zero16(sv);
    }
    slab_had_out(yv, sv, v);
    if (e >= 0)
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i] += wj * __half2float(v[i]);
  }
  if (!valid) return;
  float4* o = reinterpret_cast<float4*>(out + t * hidden + c0);
#pragma unroll
  for (int q = 0; q < 4; ++q) o[q] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
}

unsigned slab_grid(long long blocks) {  // 8 warps of kSlabPerWarp 128-blocks each
  return (unsigned)((blocks + 8 * kSlabPerWarp - 1) / (8 * kSlabPerWarp));
}

}  // namespace

}  // namespace exl3

using namespace exl3;

extern "C" {


int exl3_slab_rot_in(const void* x, int x_bf16, const void* ids, int ids_bytes, int pairs, int topk,
                     const void* gate_suh, const void* up_suh, void* a, int k, void* stream) {
  if (pairs <= 0 || topk <= 0 || pairs % topk || k <= 0 || k % 128 || (ids_bytes != 4 && ids_bytes != 8)) return -3;
  const long long items = 2LL * pairs * (k / 128);
  auto launch = [&](auto* xp) {
    slab_rot_in_kernel<<<slab_grid(items), 256, 0, (cudaStream_t)stream>>>(
        xp, ids, ids_bytes, pairs, topk, (const half*)gate_suh, (const half*)up_suh, (half*)a, k);
  };
  if (x_bf16) launch((const __nv_bfloat16*)x);
  else launch((const half*)x);
  return (int)cudaGetLastError();
}

int exl3_slab_mid(const void* c, const void* ids, int ids_bytes, int pairs, const void* gate_svh, const void* up_svh,
                  const void* down_suh, void* h, int n, int gelu, void* stream) {
  if (pairs <= 0 || n <= 0 || n % 128 || (ids_bytes != 4 && ids_bytes != 8)) return -3;
  slab_mid_kernel<<<slab_grid((long long)pairs * (n / 128)), 256, 0, (cudaStream_t)stream>>>(
      (const half*)c, ids, ids_bytes, pairs, (const half*)gate_svh, (const half*)up_svh, (const half*)down_suh,
      (half*)h, n, gelu);
  return (int)cudaGetLastError();
}

int exl3_slab_tail(const void* y, const void* ids, int ids_bytes, const void* w, const void* down_svh, void* out,
                   int tokens, int topk, int hidden, void* stream) {
  if (tokens <= 0 || topk <= 0 || hidden <= 0 || hidden % 128 || (ids_bytes != 4 && ids_bytes != 8)) return -3;
  slab_tail_kernel<<<slab_grid((long long)tokens * (hidden / 128)), 256, 0, (cudaStream_t)stream>>>(
      (const half*)y, ids, ids_bytes, (const float*)w, (const half*)down_svh, (float*)out, tokens, topk, hidden);
  return (int)cudaGetLastError();
}

}  // extern "C"
