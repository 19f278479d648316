// Whether this build's code for the running GPU has the wgmma kernels: the probe behind exl3_wgmma_available().
#include "../common/base.cuh"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EXL3_HAS_WGMMA 1
#endif

namespace exl3 {
namespace {

// Writes 1 where this library's code for the running GPU has the wgmma kernels (built for sm_90a), else 0.
__global__ void wgmma_probe_kernel(int* out) {
#ifdef EXL3_HAS_WGMMA
  *out = 1;
#else
  *out = 0;
#endif
}

}  // namespace

int g_wgmma = -1;

}  // namespace exl3

using namespace exl3;

extern "C" {

// 1 where this build has the wgmma ring kernels for the current GPU (compiled for sm_90a and running on it), else 0;
// below -1000: -1000 - a CUDA error. Runs a probe kernel and synchronizes, so call it outside graph capture; the
// wgmma ring modes are refused until it has answered 1.
int exl3_wgmma_available(void) {
  int* flag = nullptr;
  int got = 0;
  cudaError_t e = cudaMalloc(&flag, sizeof(int));
  if (e != cudaSuccess) return -1000 - (int)e;
  exl3::wgmma_probe_kernel<<<1, 1>>>(flag);
  e = cudaMemcpy(&got, flag, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(flag);
  if (e != cudaSuccess) return -1000 - (int)e;
  exl3::g_wgmma = got;
  return got;
}

}  // extern "C"
