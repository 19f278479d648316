// The MoE forward for one source per (token, expert) pair in two launches. Launchers per (bits, codebook) in their
// own units (moe_decode_instances.cu).
#pragma once

#include "../common/group_source.cuh"

namespace exl3 {

// The fused forward (moe.cu) is six launches at m = 1 (table, input rotation, gate/up GEMM, moe_mid, down GEMM,
// moe_tail) and its glue cost ~11 us of kernel time plus the gaps between them (H200).
// Here the gate/up launch finds each pair's expert from the routing itself, rotates its block's K slice of x into
// shared memory (128-element blocks: a slice of whole blocks is local), runs the GEMM, and the last block to finish
// a (pair, 128 columns) does moe_mid's work for it; the down launch (programmatic dependent: scheduled while the
// first drains, waiting for it only before reading its output) runs the GEMM and the last block per (token,
// 128 columns) does moe_tail's work, writing fp32, fp16 or bf16. Every rounding and summation order of the fused
// forward is kept: with the same splits the result is bit-identical. Per-launch counters (zero between calls, each
// reset by the block that completes it) find the last block.
struct MoeDecodeArgs {  // by value: a captured launch keeps its own copy
  const void* x;                                   // fp16 or bf16 [tokens, hidden]
  const GroupSource* gate, *up, *down;             // bank rows, one per local expert
  const void* ids;                                 // [tokens * topk] int32/int64; below 0: not this rank's
  const float* w;                                  // [tokens * topk]
  float* partial_gu;                               // [pairs, 2, gu_splits, inter]
  half* xh_dn;                                     // [pairs, inter]: act(gate) * up, rotated for down
  float* partial_dn;                               // [pairs, dn_splits, hidden]
  int* counters;                                   // [pairs * inter / 128 + tokens * hidden / 128], zero
  void* out;                                       // [tokens, hidden] fp32 / fp16 / bf16 (out_kind 0 / 1 / 2)
  int ids_bytes, pairs, topk, hidden, inter, gu_splits, dn_splits, gelu, out_kind;
};

template <int K2, int CB>
struct MoeDecode {
  // the gate/up launch (x fp16, or bf16 with x_bf16), then the down launch (a programmatic dependent with pdl)
  static int gate_up(const MoeDecodeArgs& a, int x_bf16, cudaStream_t stream);
  static int down(const MoeDecodeArgs& a, int pdl, cudaStream_t stream);
};

}  // namespace exl3
