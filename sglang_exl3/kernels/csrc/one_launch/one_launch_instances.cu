// One (bits, codebook) variant of the one-launch linear: EXL3_K2 and EXL3_CB come from the build (kernels/build.py).
#include "one_launch_kernel.cuh"

template struct exl3::OneLaunch<EXL3_K2, EXL3_CB>;
