// One (bits, codebook) variant of the mma.sync x ring: EXL3_K2 and EXL3_CB come from the build (kernels/build.py).
#include "ring_kernel.cuh"

template struct exl3::Ring<EXL3_K2, EXL3_CB>;
