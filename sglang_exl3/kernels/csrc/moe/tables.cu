// The MoE forwards' tables from the routing, on the device (capturable) or, for tests, the same code on the host:
// per-pair source rows, the expert-sorted plan and its tile rows, and the sorted input's gather.
#include <vector>

#include "../common/group_source.cuh"
#include "../common/moe_common.cuh"

namespace exl3 {
namespace {

// Routed groups: source p of bank b = (pair p's expert, x row p / x_row_div); sizes per source are uniform
// within a bank, so the offsets are arithmetic. ids are the routing as it comes (int32 or int64, flattened
// [tokens * top-k]); an id below 0 (another expert-parallel rank's expert) reads expert 0 and is weighed 0 by the
// combine. Host and device: the host builder below checks it against the Python reference without a GPU.
constexpr int kMaxRoutedBanks = 4;

struct RoutedBanks {  // by value: a captured launch keeps its own copy
  const long long* rows[kMaxRoutedBanks];
  long long item0[kMaxRoutedBanks], col0[kMaxRoutedBanks], base0[kMaxRoutedBanks];
  long long items[kMaxRoutedBanks], cols[kMaxRoutedBanks], part[kMaxRoutedBanks];
  int x_row_div[kMaxRoutedBanks];  // gate/up read token rows (p / top-k), down reads pair rows (p / 1)
};


__host__ __device__ __forceinline__ void routed_source(const RoutedBanks& b, int bank, const void* ids, int ids_bytes,
                                                       int p, long long* __restrict__ out) {
  const long long e = routed_id(ids, ids_bytes, p);
  const long long* r = b.rows[bank] + (e < 0 ? 0 : e) * 8;
  out[0] = r[0];
  out[1] = r[1];
  out[2] = r[2];
  out[3] = r[3];
  out[4] = p / b.x_row_div[bank];
  out[5] = b.item0[bank] + p * b.items[bank];
  out[6] = b.col0[bank] + p * b.cols[bank];
  out[7] = b.base0[bank] + p * b.part[bank];
}

__global__ void routed_tables_kernel(RoutedBanks b, const void* ids, int ids_bytes, int pairs,
                                     long long* __restrict__ table) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  const int bank = blockIdx.y;
  if (p < pairs) routed_source(b, bank, ids, ids_bytes, p, table + ((long long)bank * pairs + p) * 8);
}

// Expert-sorted tiles' group tables (kernels/moe_sorted.py sorted_tables) in one launch for every bank: row (bank, s)
// is tile s's expert's tiles / suh / svh, n_tiles | splits << 32 (the bank's K splits; no tiles past the `filled`
// ones), x rows from s * tile, its first work item (numbered over the filled tiles, bank by bank within its group),
// its first output column and partial element (laid out for every tile, [splits, tile, N] each). The torch ops this
// replaces were ~14 launches per bank.
struct SortedBanks {  // by value: a captured launch keeps its own copy
  const long long* rows[kMaxRoutedBanks];
  long long n_tiles[kMaxRoutedBanks], items_before[kMaxRoutedBanks], cols_before[kMaxRoutedBanks];
  long long parts_before[kMaxRoutedBanks], splits[kMaxRoutedBanks];
};

__host__ __device__ __forceinline__ void sorted_source(const SortedBanks& b, int bank, const long long* src_expert,
                                                       long long filled, long long s, int tile,
                                                       long long* __restrict__ out) {
  const long long* r = b.rows[bank] + src_expert[s] * 8;
  const long long n = b.n_tiles[bank], splits = b.splits[bank];
  out[0] = r[0];
  out[1] = r[1];
  out[2] = r[2];
  out[3] = (s < filled ? n : 0) | (splits << 32);
  out[4] = s * tile;
  out[5] = filled * b.items_before[bank] + (s < filled ? s : filled) * n * splits;
  out[6] = b.cols_before[bank] + s * n * 16;
  out[7] = b.parts_before[bank] + s * n * 16 * splits;
}

__global__ void sorted_tables_kernel(SortedBanks b, const long long* src_expert, const long long* filled, int sources,
                                     int tile, long long* __restrict__ table) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x, bank = blockIdx.y;
  if (s < sources) sorted_source(b, bank, src_expert, *filled, s, tile, table + ((long long)bank * sources + s) * 8);
}

// The expert-sorted plan (kernels/moe_sorted.py sorted_plan) in one launch, where its torch ops took ~25 launches.
// rows[p]: pair p's row in the sorted, tiled input, its expert's first tile * tile + its rank among the earlier pairs
// of that expert (a stable order); ids outside [0, experts) get the dump row sources * tile. src_expert[s]: tile s's
// expert (past the filled tiles, the last expert); filled: the tiles in use. One block: pairs in chunks of its
// threads, a pair's rank from its warp's match mask plus the counts of the warps before it and of earlier chunks.
constexpr int kPlanThreads = 256, kPlanWarps = kPlanThreads / 32;
constexpr int kMaxPlanExperts = 1024;  // shared memory: (9 * (E + 1) + E + 256) ints, 42 KB at 1,024 experts

__host__ __device__ __forceinline__ int plan_expert(const void* ids, int ids_bytes, int p, int experts) {
  const long long id = routed_id(ids, ids_bytes, p);
  return id < 0 || id >= experts ? experts : (int)id;  // `experts`: no tile (another rank's expert)
}

__host__ __device__ __forceinline__ int plan_tiles(int count, int tile) { return (count + tile - 1) / tile; }

// pair p's row from its expert e and its rank among that expert's earlier pairs: the expert's first tile * tile +
// rank, or the dump row sources * tile (e == experts: no tile)
__host__ __device__ __forceinline__ long long plan_row(const int* tile_end, const int* counts, int e, long long rank,
                                                       int experts, int tile, int sources) {
  return e < experts ? (long long)(tile_end[e] - plan_tiles(counts[e], tile)) * tile + rank : (long long)sources * tile;
}

// tile s's expert: the first whose inclusive tile end passes s (searchsorted, right), clamped to the last expert
__host__ __device__ __forceinline__ long long plan_source_expert(const int* tile_end, int experts, int s) {
  int lo = 0, hi = experts;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (tile_end[mid] > s) hi = mid; else lo = mid + 1;
  }
  return lo < experts ? lo : experts - 1;
}

__global__ void __launch_bounds__(kPlanThreads) sorted_plan_kernel(const void* ids, int ids_bytes, int pairs,
                                                                   int experts, int tile, int sources,
                                                                   long long* __restrict__ rows,
                                                                   long long* __restrict__ src_expert,
                                                                   long long* __restrict__ filled) {
  extern __shared__ int plan_sm[];
  const int e1 = experts + 1, t = threadIdx.x, lane = t & 31, warp = t >> 5;
  int* running = plan_sm;                     // [e1]: pairs of each expert in earlier chunks
  int* warp_count = running + e1;             // [kPlanWarps, e1]: this chunk's pairs per warp and expert
  int* tile_end = warp_count + kPlanWarps * e1;  // [experts]: inclusive prefix of tiles
  int* scan = tile_end + experts;             // [kPlanThreads]
  for (int i = t; i < (kPlanWarps + 1) * e1; i += kPlanThreads) plan_sm[i] = 0;
  __syncthreads();
  for (int base = 0; base < pairs; base += kPlanThreads) {
    const int p = base + t;
    const int e = p < pairs ? plan_expert(ids, ids_bytes, p, experts) : -1;  // -1: past the last pair
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int before = __popc(same & ((1u << lane) - 1u));
    if (e >= 0 && before == 0) warp_count[warp * e1 + e] = __popc(same);
    __syncthreads();
    if (e >= 0) {
      int rank = running[e] + before;
      for (int w = 0; w < warp; ++w) rank += warp_count[w * e1 + e];
      rows[p] = rank;  // the rank, until the tiles are known
    }
    __syncthreads();
    for (int x = t; x < e1; x += kPlanThreads) {
      int sum = 0;
      for (int w = 0; w < kPlanWarps; ++w) {
        sum += warp_count[w * e1 + x];
        warp_count[w * e1 + x] = 0;
      }
      running[x] += sum;
    }
    __syncthreads();
  }
  // tile ends: thread t sums its run of experts, a scan over threads, then each run's inclusive prefixes
  const int per = (experts + kPlanThreads - 1) / kPlanThreads, x0 = min(experts, t * per), x1 = min(experts, x0 + per);
  int local = 0;
  for (int x = x0; x < x1; ++x) local += plan_tiles(running[x], tile);
  scan[t] = local;
  __syncthreads();
  for (int off = 1; off < kPlanThreads; off <<= 1) {
    const int v = t >= off ? scan[t - off] : 0;
    __syncthreads();
    scan[t] += v;
    __syncthreads();
  }
  int end = scan[t] - local;
  for (int x = x0; x < x1; ++x) tile_end[x] = end += plan_tiles(running[x], tile);
  __syncthreads();
  if (t == 0) *filled = tile_end[experts - 1];
  for (int p = t; p < pairs; p += kPlanThreads)  // the pairs this thread ranked: its own writes
    rows[p] = plan_row(tile_end, running, plan_expert(ids, ids_bytes, p, experts), rows[p], experts, tile, sources);
  for (int s = t; s < sources; s += kPlanThreads) src_expert[s] = plan_source_expert(tile_end, experts, s);
}

// The same plan on the host, one pair at a time (its ranks are the running counts the kernel's chunks reproduce)
void sorted_plan_host(const void* ids, int ids_bytes, int pairs, int experts, int tile, int sources, long long* rows,
                      long long* src_expert, long long* filled) {
  std::vector<int> running(experts + 1, 0), tile_end(experts, 0);
  for (int p = 0; p < pairs; ++p) rows[p] = running[plan_expert(ids, ids_bytes, p, experts)]++;
  int end = 0;
  for (int x = 0; x < experts; ++x) tile_end[x] = end += plan_tiles(running[x], tile);
  *filled = end;
  for (int p = 0; p < pairs; ++p)
    rows[p] = plan_row(tile_end.data(), running.data(), plan_expert(ids, ids_bytes, p, experts), rows[p], experts,
                       tile, sources);
  for (int s = 0; s < sources; ++s) src_expert[s] = plan_source_expert(tile_end.data(), experts, s);
}

// xs[rows[p]] = x[p / topk]: each pair's token row into its place in the sorted input (16-byte pieces; h16: pieces
// per row). Pairs of other ranks all write the dump row, which nothing reads.
__global__ void sorted_gather_kernel(const uint4* __restrict__ x, const long long* __restrict__ rows, int pairs,
                                     int topk, int h16, uint4* __restrict__ xs) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)pairs * h16) return;
  const long long p = i / h16, c = i % h16;
  xs[rows[p] * h16 + c] = x[(p / topk) * h16 + c];
}

// MoE glue around the routed GEMMs, one launch each (the torch ops they replace cost a launch apiece: at decode

}  // namespace

}  // namespace exl3

using namespace exl3;

extern "C" {

// Every bank's rows of routed group tables in one launch (table: int64 [banks * pairs, 8], bank by bank; the banks
// of several groups, e.g. gate/up then down, each group's offsets starting at 0). `params` is host memory, 8 int64
// per bank: rows pointer, item0, col0, base0, items, cols, part, x_row_div. `on_host` = 1 runs the same code on
// host memory (tests).
int exl3_routed_tables(const long long* params, int banks, const void* ids, int ids_bytes, int pairs, void* table,
                       int on_host, void* stream) {
  if (banks <= 0 || banks > kMaxRoutedBanks || pairs < 0 || (ids_bytes != 4 && ids_bytes != 8)) return -3;
  if (pairs == 0) return 0;
  RoutedBanks b{};
  for (int i = 0; i < banks; ++i) {
    const long long* q = params + i * 8;
    if (!q[0] || q[4] <= 0 || q[5] <= 0 || q[6] <= 0 || q[7] <= 0) return -3;
    b.rows[i] = (const long long*)q[0];
    b.item0[i] = q[1]; b.col0[i] = q[2]; b.base0[i] = q[3]; b.items[i] = q[4]; b.cols[i] = q[5]; b.part[i] = q[6];
    b.x_row_div[i] = (int)q[7];
  }
  auto out = (long long*)table;
  if (on_host) {
    for (int i = 0; i < banks; ++i)
      for (int p = 0; p < pairs; ++p) routed_source(b, i, ids, ids_bytes, p, out + ((long long)i * pairs + p) * 8);
    return 0;
  }
  const dim3 grid((pairs + 127) / 128, banks);
  routed_tables_kernel<<<grid, 128, 0, (cudaStream_t)stream>>>(b, ids, ids_bytes, pairs, out);
  return (int)cudaGetLastError();
}

// Every bank's rows of expert-sorted tables in one launch (table: int64 [banks * sources, 8], bank by bank).
// `params` is host memory, 6 int64 per bank: rows pointer, n_tiles, the items, the columns and the partial elements
// of the banks before it in its group (per filled tile, per tile and per tile), its K splits (1-1024). src_expert:
// int64 [sources]; filled: one int64, both on the device (`on_host` = 1: host memory, the same code, for tests).
int exl3_sorted_tables(const long long* params, int banks, const void* src_expert, const void* filled, int sources,
                       int tile, void* table, int on_host, void* stream) {
  if (banks <= 0 || banks > kMaxRoutedBanks || sources <= 0 || tile <= 0 || !src_expert || !filled || !table)
    return -3;
  SortedBanks b{};
  for (int i = 0; i < banks; ++i) {
    const long long* q = params + i * 6;
    if (!q[0] || q[1] <= 0 || q[2] < 0 || q[3] < 0 || q[4] < 0 || q[5] <= 0 || q[5] > 1024) return -3;
    b.rows[i] = (const long long*)q[0];
    b.n_tiles[i] = q[1];
    b.items_before[i] = q[2];
    b.cols_before[i] = q[3];
    b.parts_before[i] = q[4];
    b.splits[i] = q[5];
  }
  auto e = (const long long*)src_expert;
  auto out = (long long*)table;
  if (on_host) {
    const long long f = *(const long long*)filled;
    for (int i = 0; i < banks; ++i)
      for (int s = 0; s < sources; ++s) sorted_source(b, i, e, f, s, tile, out + ((long long)i * sources + s) * 8);
    return 0;
  }
  const dim3 grid((sources + 127) / 128, banks);
  sorted_tables_kernel<<<grid, 128, 0, (cudaStream_t)stream>>>(b, e, (const long long*)filled, sources, tile, out);
  return (int)cudaGetLastError();
}

// The expert-sorted plan in one launch (see sorted_plan_kernel): ids int32/int64 [pairs]; rows int64 [pairs],
// src_expert int64 [sources], filled one int64; all on the device (`on_host` = 1: host memory, the host code).
int exl3_sorted_plan(const void* ids, int ids_bytes, int pairs, int experts, int tile, int sources, void* rows,
                     void* src_expert, void* filled, int on_host, void* stream) {
  if (pairs <= 0 || experts <= 0 || experts > kMaxPlanExperts || tile <= 0 || sources <= 0 || !ids || !rows ||
      !src_expert || !filled || (ids_bytes != 4 && ids_bytes != 8))
    return -3;
  auto r = (long long*)rows, e = (long long*)src_expert, f = (long long*)filled;
  if (on_host) {
    sorted_plan_host(ids, ids_bytes, pairs, experts, tile, sources, r, e, f);
    return 0;
  }
  const int smem = (int)sizeof(int) * ((kPlanWarps + 1) * (experts + 1) + experts + kPlanThreads);
  sorted_plan_kernel<<<1, kPlanThreads, smem, (cudaStream_t)stream>>>(ids, ids_bytes, pairs, experts, tile, sources,
                                                                       r, e, f);
  return (int)cudaGetLastError();
}

// xs[rows[p]] = x[p / topk] for pairs p (x and xs of one 2-byte dtype, `hidden` a multiple of 8; rows int64 from
// exl3_sorted_plan): the sorted forward's input in one launch
int exl3_sorted_gather(const void* x, const void* rows, int pairs, int topk, int hidden, void* xs, void* stream) {
  if (pairs <= 0 || topk <= 0 || pairs % topk || hidden <= 0 || hidden % 8 || !x || !rows || !xs) return -3;
  const int h16 = hidden / 8;
  const long long n = (long long)pairs * h16;
  sorted_gather_kernel<<<(unsigned)((n + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
      (const uint4*)x, (const long long*)rows, pairs, topk, h16, (uint4*)xs);
  return (int)cudaGetLastError();
}

}  // extern "C"
