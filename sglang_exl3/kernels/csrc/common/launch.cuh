// Launch helpers: programmatic dependent launch (PDL), plain launches, the row groups of the m <= 64 kernels and
// the dynamic shared memory opt-in.
#pragma once

#include "base.cuh"

namespace exl3 {

// Defined once (common/launch.cu): whether launches on this device may go as programmatic dependents, and the
// process-wide switch of the three-launch path's launches (exl3_set_plain_pdl).
int pdl_usable();
extern int g_plain_pdl;

namespace {  // device code and launch helpers: private to each translation unit

// ---- programmatic dependent launch (PDL) ---------------------------------------------------------
// A kernel launched as a programmatic dependent may start while the launch before it still runs; it must wait
// (griddepcontrol.wait: until that launch has finished and its writes are visible) before it reads anything an
// earlier launch wrote. Without the launch attribute the wait returns at once, so the same kernel serves both.

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, warps * 32, smem, stream>>>(args...), as a programmatic dependent of the launch before it when `pdl`
// and pdl_usable()
template <typename... Params, typename... Args>
int launch_ex(void (*kernel)(Params...), dim3 grid, int warps, int smem, bool pdl, cudaStream_t stream,
              Args... args) {
  pdl = pdl && pdl_usable();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(warps * 32);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = pdl ? attr : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  return (int)cudaLaunchKernelEx(&config, kernel, args...);
}

// The three-launch path's launches (the rotations and the x-slice GEMM, whose kernels wait before they read x or
// partials) go as programmatic dependents where exl3_set_plain_pdl turned that on: each is scheduled as the launch
// before it drains, so the gap between them shrinks, and the GEMM issues its first weight loads before its wait.
template <typename... Params, typename... Args>
void launch_plain(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t stream, Args... args) {
  launch_ex(kernel, grid, threads / 32, smem, g_plain_pdl != 0, stream, args...);  // errors: cudaGetLastError
}

// Calls launch(std::integral_constant<int, MT>) for the 8-row groups m needs (MT = 1, 2, 4 or 8).
template <typename Launch>
int with_row_groups(int m, Launch&& launch) {
  if (m <= 8) launch(std::integral_constant<int, 1>{});
  else if (m <= 16) launch(std::integral_constant<int, 2>{});
  else if (m <= 32) launch(std::integral_constant<int, 4>{});
  else if (m <= 64) launch(std::integral_constant<int, 8>{});
  else return -2;
  return (int)cudaGetLastError();
}

constexpr int kMaxXsSmem = 96 << 10;

// More than the default 48 KB of dynamic shared memory needs the kernel's opt-in, set on every such launch
// (cudaFuncSetAttribute is not a stream operation, so CUDA-graph capture allows it; FlashAttention does the same).
template <typename Kernel>
void allow_smem(Kernel kernel, int smem) {
  if (smem > (48 << 10)) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxXsSmem);
}

// Launches kernel_of(row groups) with `smem` bytes of dynamic shared memory.
template <typename KernelOf, typename... Args>
int launch_with_smem(int m, int smem, dim3 grid, cudaStream_t stream, KernelOf kernel_of, Args... args) {
  if (smem > kMaxXsSmem) return -3;
  return with_row_groups(m, [&](auto mt) {
    auto kernel = kernel_of(mt);
    allow_smem(kernel, smem);
    launch_plain(kernel, grid, kWarps * 32, smem, stream, args...);
  });
}

}  // namespace
}  // namespace exl3
