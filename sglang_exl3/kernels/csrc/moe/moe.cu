// The MoE forwards' exports: the fused forward over prepared tables (five launches) and the decode forward (two).
// Host code only: the GEMMs are the gemm family's, the glue is glue.cu's, the decode kernels moe_decode's.
#include "../common/dispatch.cuh"
#include "../common/moe_common.cuh"
#include "../gemm/gemm.cuh"
#include "../hadamard/hadamard.cuh"
#include "moe.cuh"
#include "moe_decode.cuh"

using namespace exl3;

extern "C" {

int exl3_moe_fused(const void* x, int x_bf16, const void* gu_table, const void* dn_table, int sources, int rows,
                   int hidden, int inter, int gu_items, int dn_items, int gu_k2, int gu_codebook, int dn_k2,
                   int dn_codebook, void* xh_gu, void* partial_gu, void* xh_dn, void* partial_dn,
                   const void* pair_rows, const void* w, const void* ids, int ids_bytes, int tokens, int topk,
                   int gelu, int gu_xs_slice, int dn_xs_slice, void* out, void* stream) {
  if (sources <= 0 || rows <= 0 || rows > 64 || hidden <= 0 || hidden % 128 || inter <= 0 || inter % 128 ||
      gu_items <= 0 || dn_items <= 0 || tokens <= 0 || topk <= 0 || topk > kMaxFusedTopk ||
      (ids_bytes != 4 && ids_bytes != 8))
    return -3;
  auto s = (cudaStream_t)stream;
  auto gu = (const GroupSource*)gu_table;
  auto dn = (const GroupSource*)dn_table;
  had_in_group(x, x_bf16, gu, 2 * sources, (half*)xh_gu, rows, hidden, s);
  const half* xg = (const half*)xh_gu;
  float* pg = (float*)partial_gu;
  int code = [&]() -> int {
    if (gu_xs_slice > 0)
      EXL3_DISPATCH(gu_k2, gu_codebook, Gemm, group_xs,
                    (xg, gu, 2 * sources, pg, rows, hidden / 16, gu_items, gu_xs_slice, s))
    EXL3_DISPATCH(gu_k2, gu_codebook, Gemm, group, (xg, gu, 2 * sources, pg, rows, hidden / 16, gu_items, s))
  }();
  if (code != 0) return code;
  code = moe_mid(pg, gu, dn, sources, rows, inter, (half*)xh_dn, gelu, s);
  if (code != 0) return code;
  const half* xd = (const half*)xh_dn;
  float* pd = (float*)partial_dn;
  code = [&]() -> int {
    if (dn_xs_slice > 0)
      EXL3_DISPATCH(dn_k2, dn_codebook, Gemm, group_xs, (xd, dn, sources, pd, rows, inter / 16, dn_items, dn_xs_slice,
                                                         s))
    EXL3_DISPATCH(dn_k2, dn_codebook, Gemm, group, (xd, dn, sources, pd, rows, inter / 16, dn_items, s))
  }();
  if (code != 0) return code;
  return moe_tail(pd, dn, (const long long*)pair_rows, rows, (const float*)w, ids, ids_bytes, (float*)out, tokens,
                  topk, hidden, s);
}

int exl3_moe_decode(const void* x, int x_bf16, const void* gate_rows, const void* up_rows, const void* down_rows,
                    const void* ids, int ids_bytes, const void* w, int tokens, int topk, int hidden, int inter,
                    int gu_k2, int gu_codebook, int dn_k2, int dn_codebook, int gu_splits, int dn_splits,
                    void* partial_gu, void* xh_dn, void* partial_dn, void* counters, long long counters_len,
                    int gelu, void* out, int out_kind, int pdl, void* stream) {
  if (tokens <= 0 || topk <= 0 || topk > kMaxFusedTopk || hidden <= 0 || hidden % 128 || inter <= 0 ||
      inter % 128 || gu_splits <= 0 || (hidden / 128) % gu_splits || dn_splits <= 0 || (inter / 128) % dn_splits ||
      (ids_bytes != 4 && ids_bytes != 8) || out_kind < 0 || out_kind > 2 ||
      counters_len < (long long)tokens * topk * (inter / 128) + (long long)tokens * (hidden / 128))
    return -3;
  MoeDecodeArgs a;
  a.x = x;
  a.gate = (const GroupSource*)gate_rows;
  a.up = (const GroupSource*)up_rows;
  a.down = (const GroupSource*)down_rows;
  a.ids = ids;
  a.w = (const float*)w;
  a.partial_gu = (float*)partial_gu;
  a.xh_dn = (half*)xh_dn;
  a.partial_dn = (float*)partial_dn;
  a.counters = (int*)counters;
  a.out = out;
  a.ids_bytes = ids_bytes;
  a.pairs = tokens * topk;
  a.topk = topk;
  a.hidden = hidden;
  a.inter = inter;
  a.gu_splits = gu_splits;
  a.dn_splits = dn_splits;
  a.gelu = gelu;
  a.out_kind = out_kind;
  auto s = (cudaStream_t)stream;
  const int code = [&]() -> int { EXL3_DISPATCH(gu_k2, gu_codebook, MoeDecode, gate_up, (a, x_bf16, s)) }();
  if (code != 0) return code;
  EXL3_DISPATCH(dn_k2, dn_codebook, MoeDecode, down, (a, pdl, s))
}

}  // extern "C"
