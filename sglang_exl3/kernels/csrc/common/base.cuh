// What every unit includes: the CUDA headers and the constants the kernel families share.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../exl3_abi.h"

namespace exl3 {
namespace {

constexpr int kWarps = 4;  // warps per block in the GEMM and reconstruct kernels
constexpr int kDepth = 4;  // k-tiles per trellis load group in the GEMMs (double-buffered in registers)
constexpr float kRScale = 0.088388347648f;  // exllamav3's fp32 literal for 1/sqrt(128)

template <typename P>
using elem_t = std::remove_cv_t<std::remove_pointer_t<P>>;  // T of a T* (launch_plain's template arguments)

}  // namespace
}  // namespace exl3
