// The MoE glue between the grouped GEMMs: act * up, the weighted top-k combine, and the fused forward's two glue
// launches (moe_mid, moe_tail), each folding the rotations around it in.
#include "../common/group_source.cuh"
#include "../common/moe_common.cuh"
#include "../common/rotation.cuh"
#include "moe.cuh"

namespace exl3 {
namespace {

// sizes a launch costs more than the work). fp32 math, as the torch reference computes it.

// gate_up: [rows, 2 * sources * n] as a two-bank group writes it (gate sources' columns, then up's); out: the
// activation in source-major rows [sources * rows, n], the row order of a down projection over the same sources.
__host__ __device__ __forceinline__ void act_mul_one(const half* __restrict__ gate_up, half* __restrict__ out,
                                                     int sources, int rows, int n, long long i, int gelu) {
  const long long c = i % n, r = (i / n) % rows, s = i / ((long long)n * rows);
  const long long at = r * 2 * sources * n + s * n + c, up = (long long)sources * n;
  out[i] = __float2half_rn(moe_act(__half2float(gate_up[at]), gelu) * __half2float(gate_up[at + up]));
}

__global__ void act_mul_kernel(const half* __restrict__ gate_up, half* __restrict__ out, int sources, int rows,
                               int n, long long count, int gelu) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) act_mul_one(gate_up, out, sources, rows, n, i, gelu);
}

// out[t, c] = sum over j < top-k, in order, of w[t, j] * y[row of pair t * top-k + j][c], skipping ids below 0.
// A pair's row starts at y + rows[p] (element offsets; null: y + p * n).
__host__ __device__ __forceinline__ void combine_one(const half* __restrict__ y, const long long* __restrict__ rows,
                                                     const float* __restrict__ w, const void* ids, int ids_bytes,
                                                     float* __restrict__ out, int topk, int n, long long i) {
  const long long t = i / n, c = i % n;
  float acc = 0.f;
  for (int j = 0; j < topk; ++j) {
    const long long p = t * topk + j;
    if (routed_id(ids, ids_bytes, p) >= 0) acc += w[p] * __half2float(y[(rows ? rows[p] : p * n) + c]);
  }
  out[i] = acc;
}

__global__ void combine_kernel(const half* __restrict__ y, const long long* __restrict__ rows,
                               const float* __restrict__ w, const void* ids, int ids_bytes, float* __restrict__ out,
                               int topk, int n, long long count) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) combine_one(y, rows, w, ids, ids_bytes, out, topk, n, i);
}

// ---- fused MoE stages: the glue between the grouped GEMMs folded into their rotations ------------------
// Sources of a MoE forward: S gate sources, then S up sources in one table (gu), S down sources in another (dn),
// each source `rows` rows (per-pair: rows = 1, source p = pair p; sorted: a tile of rows). Source s's rows of the
// activation are the down projection's rows s * rows + r. moe_mid: per (source, row, 128 columns) a pair of warps
// rotates gate's and up's partials (one each, in parallel), then the gate warp applies the activation and rotates
// the result into the down projection's input: output rotation, act_mul and input rotation in one launch, with
// every fp16 rounding of the unfused path.
constexpr int kMidItems = 4;  // (source, row, block) items per moe_mid block: 2 warps each

__global__ void __launch_bounds__(2 * kMidItems * 32) moe_mid_kernel(
    const float* __restrict__ partial, const GroupSource* __restrict__ gu, const GroupSource* __restrict__ dn,
    int sources, int rows, int n, half* __restrict__ xh_dn, int gelu) {
  __shared__ uint2 up_vals[kMidItems][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slot = warp >> 1, role = warp & 1;
  const int item = blockIdx.x * kMidItems + slot;
  const int blocks = n / 128, per_source = rows * blocks;
  const int s = item / per_source, r = (item % per_source) / blocks, c0 = (item % blocks) * 128;
  // empty sources (sorted tables) and the grid's tail do nothing, but still reach the barrier
  const bool live = item < sources * per_source && gu[s].n_tiles != 0;
  half v[4];
  if (live) {
    const GroupSource& src = gu[role * sources + s];
    had_out_values(partial + src.partial_base * rows + (size_t)r * n + c0, (size_t)rows * n, src.splits,
                   src.svh + c0, lane, v);
    if (role == 1) up_vals[slot][lane] = *reinterpret_cast<const uint2*>(v);
  }
  __syncthreads();
  if (!live || role == 1) return;
  const uint2 uw = up_vals[slot][lane];
  const half* uv = reinterpret_cast<const half*>(&uw);
  half a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = __float2half_rn(moe_act(__half2float(v[i]), gelu) * __half2float(uv[i]));
  had_in_values(a, dn[s].suh + c0, xh_dn + ((size_t)s * rows + r) * n + c0, lane);
}

// moe_tail: out[t, c] (fp32) = sum over j < top-k, in order, of w[p] * y_p[c], p = t * top-k + j, ids below 0
// skipped, where y_p is pair p's row of the down projection rotated here from its partials: output rotation and
// combine in one launch. One block per (token, 128 columns), its warps rotate the top-k rows in parallel, one warp
// sums them in order. Pair p's row is q = pair_rows[p] (null: p): source q / rows, row q % rows.

__global__ void __launch_bounds__(256) moe_tail_kernel(
    const float* __restrict__ partial, const GroupSource* __restrict__ dn, const long long* __restrict__ pair_rows,
    int rows, const float* __restrict__ w, const void* ids, int ids_bytes, float* __restrict__ out, int topk, int h) {
  __shared__ uint2 ys[kMaxFusedTopk][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int blocks = h / 128, t = blockIdx.x / blocks, c0 = (blockIdx.x % blocks) * 128;
  for (int j = warp; j < topk; j += warps) {
    const long long p = (long long)t * topk + j;
    if (routed_id(ids, ids_bytes, p) < 0) continue;
    const long long q = pair_rows ? pair_rows[p] : p;
    const GroupSource& src = dn[q / rows];
    half y[4];
    had_out_values(partial + src.partial_base * rows + (q % rows) * h + c0, (size_t)rows * h, src.splits,
                   src.svh + c0, lane, y);
    ys[j][lane] = *reinterpret_cast<const uint2*>(y);
  }
  __syncthreads();
  if (warp != 0) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < topk; ++j) {
    const long long p = (long long)t * topk + j;
    if (routed_id(ids, ids_bytes, p) < 0) continue;
    const uint2 yw = ys[j][lane];
    const half* y = reinterpret_cast<const half*>(&yw);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += w[p] * __half2float(y[i]);
  }
  *reinterpret_cast<float4*>(out + (size_t)t * h + c0 + lane * 4) = make_float4(acc[0], acc[1], acc[2], acc[3]);
}

}  // namespace

int moe_mid(const float* partial_gu, const GroupSource* gu, const GroupSource* dn, int sources, int rows, int inter,
            half* xh_dn, int gelu, cudaStream_t s) {
  const int mid_items = sources * rows * (inter / 128);
  moe_mid_kernel<<<(mid_items + kMidItems - 1) / kMidItems, 2 * kMidItems * 32, 0, s>>>(partial_gu, gu, dn, sources,
                                                                                      rows, inter, xh_dn, gelu);
  return (int)cudaGetLastError();
}

int moe_tail(const float* partial_dn, const GroupSource* dn, const long long* pair_rows, int rows, const float* w,
             const void* ids, int ids_bytes, float* out, int tokens, int topk, int hidden, cudaStream_t s) {
  const int tail_warps = topk < 8 ? topk : 8;
  moe_tail_kernel<<<tokens * (hidden / 128), tail_warps * 32, 0, s>>>(partial_dn, dn, pair_rows, rows, w, ids,
                                                                      ids_bytes, out, topk, hidden);
  return (int)cudaGetLastError();
}

}  // namespace exl3

using namespace exl3;

extern "C" {

// out fp16 [sources * rows, n] = act(gate) * up for the fp16 [rows, 2 * sources * n] output of a two-bank group
// (silu, or gelu's tanh approximation when `gelu`), rows regrouped source by source.
int exl3_act_mul(const void* gate_up, void* out, int sources, int rows, int n, int gelu, int on_host, void* stream) {
  if (sources < 0 || rows <= 0 || n <= 0 || !gate_up || !out) return -3;
  const long long count = (long long)sources * rows * n;
  if (count == 0) return 0;
  auto g = (const half*)gate_up;
  auto o = (half*)out;
  if (on_host) {
    for (long long i = 0; i < count; ++i) act_mul_one(g, o, sources, rows, n, i, gelu);
    return 0;
  }
  act_mul_kernel<<<(unsigned)((count + 255) / 256), 256, 0, (cudaStream_t)stream>>>(g, o, sources, rows, n, count,
                                                                                     gelu);
  return (int)cudaGetLastError();
}

// out fp32 [tokens, n] = the routing-weighted sum of each token's top-k rows of fp16 y; pair p's row starts at
// y + rows[p] (int64 element offsets; null: y + p * n); w fp32 [tokens * top-k]; pairs whose id is below 0 are
// skipped.
int exl3_moe_combine(const void* y, const void* rows, const void* w, const void* ids, int ids_bytes, void* out,
                     int tokens, int topk, int n, int on_host, void* stream) {
  if (tokens < 0 || topk <= 0 || n <= 0 || (ids_bytes != 4 && ids_bytes != 8)) return -3;
  if (tokens == 0) return 0;
  const long long count = (long long)tokens * n;
  auto yy = (const half*)y;
  auto rr = (const long long*)rows;
  auto ww = (const float*)w;
  auto o = (float*)out;
  if (on_host) {
    for (long long i = 0; i < count; ++i) combine_one(yy, rr, ww, ids, ids_bytes, o, topk, n, i);
    return 0;
  }
  combine_kernel<<<(unsigned)((count + 255) / 256), 256, 0, (cudaStream_t)stream>>>(yy, rr, ww, ids, ids_bytes, o,
                                                                                     topk, n, count);
  return (int)cudaGetLastError();
}

}  // extern "C"
