// A table of GEMM sources (same-input groups, routed experts, expert-sorted tiles), read by every group kernel.
#pragma once

#include "base.cuh"

namespace exl3 {

// ---- groups of sources: one launch per stage for all of them -----------------------------------------
// Same-input groups (q/k/v, gate/up): every source reads rows [0, m) of x; the table is built once per layer
// at load. Routed-expert groups (MoE): one source per (token, expert) pair with m = 1, reading x row `x_row`,
// or one per (expert, tile of m rows) over expert-sorted rows; the table is built on the device from the
// routing, so CUDA graphs capture it. A source with n_tiles = 0 is empty (a sorted table's static bound holds
// more sources than the routing fills): it owns no work items and every stage skips it.
struct GroupSource {
  const uint32_t* tiles;  // kernel layout [n_tiles, k_tiles, words]
  const half* suh;        // [K]
  const half* svh;        // [n_tiles * 16]
  int n_tiles;
  int splits;
  long long x_row;         // first row of x this source reads
  long long item_begin;    // first GEMM work item of this source (items of all sources are numbered in order)
  long long col_begin;     // first column of this source in the concatenated output
  long long partial_base;  // this source's partials start at partial + partial_base * m ([splits, m, N])
};
static_assert(sizeof(GroupSource) == 64, "the Python side writes 8 int64 per source");

namespace {  // device code and launch helpers: private to each translation unit

// The last source whose begin (item_begin, or col_begin with kCols: both ascending) is <= v; binary search, as a
// routed group may hold thousands of sources. Host and device: the host probe below tests it without a GPU.
template <bool kCols>
__host__ __device__ __forceinline__ int group_source_at(const GroupSource* srcs, int num, long long v) {
  int lo = 0, hi = num - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if ((kCols ? srcs[mid].col_begin : srcs[mid].item_begin) <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__host__ __device__ __forceinline__ int group_source_of_item(const GroupSource* srcs, int num, long long item) {
  return group_source_at<false>(srcs, num, item);
}

// A group kernel's warp: its source s and work item within it; false where it has none (past the last item, or an
// empty source). Every source's items are a multiple of a block's warps, so a block's warps agree.
__device__ __forceinline__ bool group_work(const GroupSource* srcs, int num, int item, int total_items, int& s,
                                           int& local) {
  if (item >= total_items) return false;
  s = group_source_of_item(srcs, num, item);
  local = item - (int)srcs[s].item_begin;
  return local < srcs[s].n_tiles * srcs[s].splits;  // past the last filled source of a sorted table
}

}  // namespace
}  // namespace exl3
