// The library's own exports: its ABI digest, error strings and process-wide launch state.
#include "common/group_source.cuh"
#include "common/launch.cuh"

#ifndef EXL3_ABI_DIGEST
#error "the build passes EXL3_ABI_DIGEST (kernels/abi.py's digest of its signature table)"
#endif

using namespace exl3;

extern "C" {

const char* exl3_abi_digest(void) { return EXL3_ABI_DIGEST; }

const char* exl3_error_string(int code) {
  switch (code) {
    case -1: return "unsupported bitrate/codebook pair, or a kernel this build or GPU lacks";
    case -2: return "m too large for the fused kernel (at most 64 rows)";
    case -3: return "bad shape or argument";
    default: return cudaGetErrorString((cudaError_t)code);
  }
}

int exl3_pdl_usable(void) { return pdl_usable(); }

int exl3_set_plain_pdl(int on) {
  if (on > 1) return -3;
  const int before = g_plain_pdl;
  if (on >= 0) g_plain_pdl = on;
  return before;
}

int exl3_group_probe(const void* table, int num, long long item, long long col, long long* out) {
  if (num <= 0 || !table || !out) return -3;
  auto srcs = (const GroupSource*)table;
  const int si = group_source_of_item(srcs, num, item);
  out[0] = si;
  out[1] = group_source_at<true>(srcs, num, col);
  out[2] = srcs[si].n_tiles;
  out[3] = srcs[si].splits;
  out[4] = srcs[si].x_row;
  out[5] = srcs[si].item_begin;
  out[6] = srcs[si].partial_base;
  return 0;
}

}  // extern "C"
