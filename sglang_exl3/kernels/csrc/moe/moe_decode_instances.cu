// One (bits, codebook) variant of the MoE decode forward: EXL3_K2 and EXL3_CB come from the build (kernels/build.py).
#include "moe_decode_kernel.cuh"

template struct exl3::MoeDecode<EXL3_K2, EXL3_CB>;
