// One (bits, codebook) variant of the m <= 64 GEMMs: EXL3_K2 and EXL3_CB come from the build (kernels/build.py).
#include "gemm_kernel.cuh"

template struct exl3::Gemm<EXL3_K2, EXL3_CB>;
