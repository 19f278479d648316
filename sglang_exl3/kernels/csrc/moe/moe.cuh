// Host functions of the MoE glue (glue.cu) that the fused forward (moe.cu) launches between its GEMMs.
#pragma once

#include "../common/group_source.cuh"

namespace exl3 {

// per (source, row, 128 columns): gate's and up's output rotations, act * up, and the down projection's input rotation
int moe_mid(const float* partial_gu, const GroupSource* gu, const GroupSource* dn, int sources, int rows, int inter,
            half* xh_dn, int gelu, cudaStream_t stream);
// per (token, 128 columns): the down projection's output rotations and the weighted top-k sum, fp32 out
int moe_tail(const float* partial_dn, const GroupSource* dn, const long long* pair_rows, int rows, const float* w,
             const void* ids, int ids_bytes, float* out, int tokens, int topk, int hidden, cudaStream_t stream);

}  // namespace exl3
