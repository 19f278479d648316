// The launch state every unit shares.
#include "launch.cuh"

namespace exl3 {
namespace {

__global__ void pdl_probe_kernel() {}

}  // namespace

// Whether launches here may go as programmatic dependents: the device has PDL (compute capability 9.0+) and this
// library's kernels carry the waits (compiled from sm_90+ PTX). A build for an older arch that reaches a Hopper GPU
// as PTX has pdl_wait compiled out, and a dependent would read its predecessor's output before it is written.
int pdl_usable() {
  static int usable = -1;  // once per process (one device arch per server process); a race only repeats the query
  if (usable < 0) {
    int dev = 0, major = 0;
    cudaFuncAttributes fa{};
    const bool queried = cudaGetDevice(&dev) == cudaSuccess &&
                         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                         cudaFuncGetAttributes(&fa, pdl_probe_kernel) == cudaSuccess;
    if (!queried) cudaGetLastError();  // a failed query (no device) leaves no error for the next launch's check
    usable = queried && major >= 9 && fa.ptxVersion >= 90;
  }
  return usable;
}

int g_plain_pdl = 0;

}  // namespace exl3
