// One (K, codebook) variant of the fast trellis search: EXL3_K and EXL3_CB come from the build (kernels/build.py).
#include "encode_kernel.cuh"

template struct exl3::Encode<EXL3_K, EXL3_CB>;
