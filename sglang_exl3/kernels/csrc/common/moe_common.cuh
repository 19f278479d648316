// What the MoE families share: routing ids as they come, the activation, the top-k bound.
#pragma once

#include "base.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

__host__ __device__ __forceinline__ long long routed_id(const void* ids, int ids_bytes, long long p) {
  return ids_bytes == 4 ? (long long)((const int*)ids)[p] : ((const long long*)ids)[p];
}

__host__ __device__ __forceinline__ float moe_act(float g, int gelu) {
  if (gelu) return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));  // tanh approx.
  return g / (1.f + expf(-g));                                                                      // silu
}

// gate_up: [rows, 2 * sources * n] as a two-bank group writes it (gate sources' columns, then up's); out: the

constexpr int kMaxFusedTopk = 32;

}  // namespace
}  // namespace exl3
