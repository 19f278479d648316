// The Hadamard-128 rotation launches around the GEMMs: x * suh then Hadamard (had_in), and the split-K partials'
// sum, Hadamard, * svh (had_out), single and over a group table, each in the form its size picks (one warp or eight
// threads per 128-block: the same bits). Defined in hadamard.cu; the other families call them.
#pragma once

#include "../common/group_source.cuh"

namespace exl3 {

// the process-wide form switch (exl3_set_had_form, exl3_set_octet_min_items)
constexpr int kHadFormAuto = 0, kHadFormWarp = 1, kHadFormOctet = 2;
extern int g_had_form;
extern long long g_octet_min_items;

// out fp16 [rows, cols] = had_in(x * suh) for fp16 or bf16 x (x_bf16)
int had_in(const void* x, int x_bf16, const half* suh, half* out, int rows, int cols, cudaStream_t stream);
// out [rows, cols] (fp16, or bf16 with out_bf16) = had_out of the sum of `splits` fp32 or fp16 partials
int had_out(const void* acc, int acc_is_fp32, const half* svh, void* out, int out_bf16, int splits, int rows,
            int cols, cudaStream_t stream);
// xh_all[s, r, :] = had_in(x[x_row_s + r, :], suh_s) for every source s of the table
void had_in_group(const void* x, int x_bf16, const GroupSource* srcs, int num, half* xh_all, int rows, int cols,
                  cudaStream_t stream);
// out [rows, total_cols] = every source's had_out of its partials, into its columns
void had_out_group(const float* partial, const GroupSource* srcs, int num, void* out, int out_bf16, int rows,
                   int total_cols, cudaStream_t stream);

}  // namespace exl3
