// The reconstruct's export.
#include "../common/dispatch.cuh"
#include "reconstruct.cuh"

using namespace exl3;

extern "C" {

int exl3_reconstruct(const void* trellis, void* out, int k_tiles, int n_tiles, int tn0, int tn_count, int ld,
                     int k2, int codebook, void* stream) {
  if (k_tiles <= 0 || tn_count <= 0 || tn0 < 0 || tn0 + tn_count > n_tiles || ld < tn_count * 16 || ld % 8)
    return -3;
  auto s = (cudaStream_t)stream;
  auto t = (const uint32_t*)trellis;
  auto o = (half*)out;
  EXL3_DISPATCH(k2, codebook, Reconstruct, run, (t, o, k_tiles, n_tiles, tn0, tn_count, ld, s))
}

}  // extern "C"
