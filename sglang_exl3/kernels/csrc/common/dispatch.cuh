// The (bits, codebook) variants every templated kernel family is built for, and the switch that calls a family's
// launcher for one of them. The library builds one unit per (family, variant) (kernels/build.py lists the same
// variants; tests/test_kernel_build.py checks that the two lists agree).
#pragma once

// Calls FAMILY<K2, CB>::MEMBER ARGS for the supported (K2 = 2 * bits, codebook) pairs: whole bits 1..8 in every
// codebook, half bits (K2 odd: 1.5, 2.5, 3.5) in MUL1. Returns -1 (unsupported) for anything else.
#define EXL3_CASE1(K2, CB, FAMILY, MEMBER, ARGS) \
  case (K2) * 4 + (CB): return FAMILY<K2, CB>::MEMBER ARGS;
#define EXL3_CASE3(K2, FAMILY, MEMBER, ARGS)                                               \
  EXL3_CASE1(K2, 0, FAMILY, MEMBER, ARGS) EXL3_CASE1(K2, 1, FAMILY, MEMBER, ARGS)          \
  EXL3_CASE1(K2, 2, FAMILY, MEMBER, ARGS)
#ifdef EXL3_DEV_4BIT_MCG  // kernel development: only 4-bit MCG, built in a fraction of the time (never shipped)
#define EXL3_DISPATCH(K2V, CBV, FAMILY, MEMBER, ARGS) \
  switch ((K2V) * 4 + (CBV)) {                        \
    EXL3_CASE1(8, 1, FAMILY, MEMBER, ARGS)            \
    default: return -1;                               \
  }
#else
#define EXL3_DISPATCH(K2V, CBV, FAMILY, MEMBER, ARGS)                                                            \
  switch ((K2V) * 4 + (CBV)) {                                                                                   \
    EXL3_CASE3(2, FAMILY, MEMBER, ARGS) EXL3_CASE3(4, FAMILY, MEMBER, ARGS) EXL3_CASE3(6, FAMILY, MEMBER, ARGS)  \
    EXL3_CASE3(8, FAMILY, MEMBER, ARGS) EXL3_CASE3(10, FAMILY, MEMBER, ARGS)                                     \
    EXL3_CASE3(12, FAMILY, MEMBER, ARGS) EXL3_CASE3(14, FAMILY, MEMBER, ARGS)                                    \
    EXL3_CASE3(16, FAMILY, MEMBER, ARGS) EXL3_CASE1(3, 2, FAMILY, MEMBER, ARGS)                                  \
    EXL3_CASE1(5, 2, FAMILY, MEMBER, ARGS) EXL3_CASE1(7, 2, FAMILY, MEMBER, ARGS)                                \
    default: return -1;                                                                                          \
  }
#endif
