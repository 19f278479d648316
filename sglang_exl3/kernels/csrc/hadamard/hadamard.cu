// The rotation launches (hadamard.cuh) and their exports.
#include "hadamard.cuh"
#include "hadamard_kernel.cuh"

namespace exl3 {

int g_had_form = kHadFormAuto;
long long g_octet_min_items = 4096;

namespace {

// Which form a rotation launch takes: kHadFormAuto picks the octet form from g_octet_min_items 128-blocks (the
// Python side sets the measured crossover when it loads the library), except over fp32 split-K partials, where the
// warp form's eight loads in flight per lane measured faster at every size (rotation-ab); exl3_set_had_form pins
// one form for the whole process (A/B measurements)
bool use_octet(long long items, bool fp32_partials) {
  if (g_had_form != kHadFormAuto) return g_had_form == kHadFormOctet;
  return !fp32_partials && items >= g_octet_min_items;
}
unsigned octet_grid(long long items) { return (unsigned)((items + kOctetItems - 1) / kOctetItems); }

// xh_all[s, r, :] = had_in(x[x_row_s + r, :], suh_s) for every source s, in the form the size picks
template <typename T>
void launch_had_in_group(const T* x, const GroupSource* srcs, int num, half* xh_all, int rows, int cols,
                         cudaStream_t s) {
  const long long items = (long long)num * rows * (cols / 128);
  if (use_octet(items, false))
    launch_plain(had_in_group_octet_kernel<T>, dim3(octet_grid(items)), 256, 0, s, x, srcs, num, xh_all, rows, cols);
  else
    launch_plain(had_in_group_kernel<T>, dim3((unsigned)((items + 7) / 8)), 256, 0, s, x, srcs, num, xh_all, rows,
                 cols);
}

}  // namespace

int had_in(const void* x, int x_bf16, const half* suh, half* out, int rows, int cols, cudaStream_t s) {
  const long long items = (long long)rows * (cols / 128);
  auto launch = [&](auto* xp) {
    if (use_octet(items, false))
      launch_plain(had_in_octet_kernel<elem_t<decltype(xp)>>, dim3(octet_grid(items)), 256, 0, s, xp, suh, out, rows,
                   cols);
    else
      launch_plain(had_in_kernel<elem_t<decltype(xp)>>, dim3((unsigned)((items + 7) / 8)), 256, 0, s, xp, suh, out,
                   rows, cols);
  };
  if (x_bf16) launch((const __nv_bfloat16*)x);
  else launch((const half*)x);
  return (int)cudaGetLastError();
}

int had_out(const void* acc, int acc_is_fp32, const half* svh, void* out, int out_bf16, int splits, int rows,
            int cols, cudaStream_t s) {
  const long long items = (long long)rows * (cols / 128);
  auto launch = [&](auto* o) {
    auto run = [&](auto* a) {
      if (use_octet(items, acc_is_fp32))
        launch_plain(had_out_octet_kernel<elem_t<decltype(a)>, elem_t<decltype(o)>>, dim3(octet_grid(items)), 256, 0,
                     s, a, svh, o, splits, rows, cols);
      else
        launch_plain(had_out_kernel<elem_t<decltype(a)>, elem_t<decltype(o)>>, dim3((unsigned)((items + 7) / 8)), 256,
                     0, s, a, svh, o, splits, rows, cols);
    };
    if (acc_is_fp32) run((const float*)acc);
    else run((const half*)acc);
  };
  if (out_bf16) launch((__nv_bfloat16*)out);
  else launch((half*)out);
  return (int)cudaGetLastError();
}

void had_in_group(const void* x, int x_bf16, const GroupSource* srcs, int num, half* xh_all, int rows, int cols,
                  cudaStream_t s) {
  if (x_bf16) launch_had_in_group((const __nv_bfloat16*)x, srcs, num, xh_all, rows, cols, s);
  else launch_had_in_group((const half*)x, srcs, num, xh_all, rows, cols, s);
}

void had_out_group(const float* p, const GroupSource* srcs, int num, void* out, int out_bf16, int m, int total_cols,
                   cudaStream_t s) {
  const int out_items = m * (total_cols / 128);
  auto rotate_out = [&](auto* o) {
    if (use_octet(out_items, true))
      launch_plain(had_out_group_octet_kernel<elem_t<decltype(o)>>, dim3(octet_grid(out_items)), 256, 0, s, p, srcs,
                   num, o, m, total_cols);
    else
      launch_plain(had_out_group_kernel<elem_t<decltype(o)>>, dim3((out_items + 7) / 8), 256, 0, s, p, srcs, num, o, m,
                   total_cols);
  };
  if (out_bf16) rotate_out((__nv_bfloat16*)out);
  else rotate_out((half*)out);
}

}  // namespace exl3

using namespace exl3;

extern "C" {

// x fp16, or bf16 (x_bf16: rounded to fp16 as it is read, exactly what casting it beforehand does)
int exl3_had_in(const void* x, int x_bf16, const void* suh, void* out, int rows, int cols, void* stream) {
  if (rows <= 0 || cols <= 0 || cols % 128) return -3;
  return exl3::had_in(x, x_bf16, (const half*)suh, (half*)out, rows, cols, (cudaStream_t)stream);
}

// out fp16, or bf16 (out_bf16: the fp16 result rounded to bf16, exactly what casting it afterwards does)
int exl3_had_out(const void* acc, int acc_is_fp32, const void* svh, void* out, int out_bf16, int splits, int rows,
                 int cols, void* stream) {
  if (rows <= 0 || cols <= 0 || cols % 128 || splits <= 0) return -3;
  return exl3::had_out(acc, acc_is_fp32, (const half*)svh, out, out_bf16, splits, rows, cols, (cudaStream_t)stream);
}

// Pins the form of every later rotation launch (0: by size, 1: one warp per 128-block, 2: eight threads per
// 128-block), for A/B measurements; the two forms give the same bits. Returns the previous form, or -3.
int exl3_set_had_form(int form) {
  if (form < exl3::kHadFormAuto || form > exl3::kHadFormOctet) return -3;
  const int before = exl3::g_had_form;
  exl3::g_had_form = form;
  return before;
}

// The size (in 128-blocks of one launch) from which kHadFormAuto takes the octet form; returns the previous one
long long exl3_set_octet_min_items(long long items) {
  const long long before = exl3::g_octet_min_items;
  if (items >= 0) exl3::g_octet_min_items = items;
  return before;
}

}  // extern "C"
