// One (bits, codebook) variant of the wgmma x ring: EXL3_K2 and EXL3_CB come from the build (kernels/build.py).
#include "wgmma_kernel.cuh"

template struct exl3::Wgmma<EXL3_K2, EXL3_CB>;
