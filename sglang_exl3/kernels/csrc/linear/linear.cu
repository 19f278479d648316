// The dense linear's exports: split-K partials of one linear in each GEMM form, a same-input group's three launches
// (input rotation, GEMM, output rotation), its wgmma form that rotates in the launch, and the one-launch linear. Host
// code only: the kernels are the families' (gemm, ring, wgmma, one_launch, hadamard).
#include "../common/dispatch.cuh"
#include "../gemm/gemm.cuh"
#include "../hadamard/hadamard.cuh"
#include "../one_launch/one_launch.cuh"
#include "../ring/ring.cuh"
#include "../wgmma/wgmma.cuh"

using namespace exl3;

namespace {

int gemm_partial(bool xs, const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                 int splits, int k2, int codebook, void* stream) {
  if (m <= 0 || k_tiles <= 0 || n_tiles <= 0 || splits <= 0 || splits > k_tiles) return -3;
  auto s = (cudaStream_t)stream;
  auto x = (const half*)xh;
  auto t = (const uint32_t*)trellis;
  auto p = (float*)partial;
  if (xs) EXL3_DISPATCH(k2, codebook, Gemm, partial_xs, (x, t, p, m, k_tiles, n_tiles, splits, s))
  EXL3_DISPATCH(k2, codebook, Gemm, partial, (x, t, p, m, k_tiles, n_tiles, splits, s))
}

}  // namespace

extern "C" {

int exl3_gemm_partial(const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                      int splits, int k2, int codebook, void* stream) {
  return gemm_partial(false, xh, trellis, partial, m, k_tiles, n_tiles, splits, k2, codebook, stream);
}

int exl3_gemm_partial_xs(const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                         int splits, int k2, int codebook, void* stream) {
  return gemm_partial(true, xh, trellis, partial, m, k_tiles, n_tiles, splits, k2, codebook, stream);
}

int exl3_gemm_partial_ring(const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                           int splits, int k2, int codebook, int mode, void* stream) {
  if (m <= 0 || k_tiles <= 0 || n_tiles <= 0 || splits <= 0 || splits > k_tiles ||
      !(ring_mode_ok(mode) || wg_mode_ok(mode)))
    return -3;
  auto s = (cudaStream_t)stream;
  auto x = (const half*)xh;
  auto t = (const uint32_t*)trellis;
  auto p = (float*)partial;
  if (wg_mode_ok(mode)) EXL3_DISPATCH(k2, codebook, Wgmma, partial, (x, t, p, m, k_tiles, n_tiles, splits, mode, s))
  EXL3_DISPATCH(k2, codebook, Ring, partial, (x, t, p, m, k_tiles, n_tiles, splits, mode, s))
}

int exl3_group_linear(const void* x, int x_bf16, const void* table, int num, void* xh_all, void* partial, void* out,
                      int y_bf16, int m, int k_tiles, int total_items, int total_cols, int k2, int codebook,
                      int xs_slice, int ring_mode, void* stream) {
  if (m <= 0 || num <= 0 || k_tiles <= 0 || total_items <= 0 || total_cols <= 0 || total_cols % 128) return -3;
  const bool ring = ring_mode_ok(ring_mode), wg = wg_mode_ok(ring_mode);
  auto s = (cudaStream_t)stream;
  auto srcs = (const GroupSource*)table;
  had_in_group(x, x_bf16, srcs, num, (half*)xh_all, m, k_tiles * 16, s);
  const half* xh = (const half*)xh_all;
  float* p = (float*)partial;
  const int code = [&]() -> int {
    if (wg) EXL3_DISPATCH(k2, codebook, Wgmma, group, (xh, srcs, num, p, m, k_tiles, total_items, ring_mode, s))
    if (ring) EXL3_DISPATCH(k2, codebook, Ring, group, (xh, srcs, num, p, m, k_tiles, total_items, ring_mode, s))
    if (xs_slice > 0)
      EXL3_DISPATCH(k2, codebook, Gemm, group_xs, (xh, srcs, num, p, m, k_tiles, total_items, xs_slice, s))
    EXL3_DISPATCH(k2, codebook, Gemm, group, (xh, srcs, num, p, m, k_tiles, total_items, s))
  }();
  if (code != 0) return code;
  had_out_group(p, srcs, num, out, y_bf16, m, total_cols, s);
  return (int)cudaGetLastError();
}

int exl3_group_linear_rotating(const void* x, int x_bf16, const void* table, int num, void* xh_all, void* out,
                               int y_bf16, int m, int k_tiles, int total_items, int total_cols, int k2, int codebook,
                               void* stream) {
  if (m <= 0 || m > 64 || num <= 0 || k_tiles <= 0 || total_items <= 0 || total_cols <= 0 || total_cols % 128 ||
      total_items % 8)
    return -3;
  if (g_wgmma != 1) return -1;
  auto s = (cudaStream_t)stream;
  auto srcs = (const GroupSource*)table;
  had_in_group(x, x_bf16, srcs, num, (half*)xh_all, m, k_tiles * 16, s);
  const half* xh = (const half*)xh_all;
  EXL3_DISPATCH(k2, codebook, Wgmma, group_rotating, (xh, srcs, num, out, y_bf16, m, k_tiles, total_items, total_cols,
                                                      s))
}

int exl3_linear_decode(const void* x, int bf16, const void* table, int num, void* partial, void* counters,
                       long long counters_len, void* out, int m, int k_tiles, int total_items, int total_cols, int k2,
                       int codebook, int xs_slice, int pdl, void* stream) {
  if (m <= 0 || m > kOneLaunchMaxRows || num <= 0 || k_tiles <= 0 || k_tiles % 8 || total_items <= 0 ||
      total_cols <= 0 || total_cols % 128 || xs_slice <= 0 || xs_slice % 8 || counters_len < total_cols / 128)
    return -3;
  auto s = (cudaStream_t)stream;
  auto srcs = (const GroupSource*)table;
  auto p = (float*)partial;
  auto c = (int*)counters;
  EXL3_DISPATCH(k2, codebook, OneLaunch, run, (x, bf16, srcs, num, p, c, out, m, k_tiles, total_items, total_cols,
                                               xs_slice, pdl, s))
}

}  // extern "C"
