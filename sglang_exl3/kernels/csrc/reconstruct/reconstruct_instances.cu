// One (bits, codebook) variant of the reconstruct: EXL3_K2 and EXL3_CB come from the build (kernels/build.py).
#include "reconstruct_kernel.cuh"

template struct exl3::Reconstruct<EXL3_K2, EXL3_CB>;
