// The library's exported C ABI: every function kernels/abi.py declares to ctypes (one table there; a CPU test checks
// that it and these prototypes agree), and the codes they share. Plain C: no torch, loaded with ctypes.
//
// Return codes: 0 ok, -1 unsupported (bits, codebook) or a kernel this build or GPU lacks, -2 unsupported m, -3 bad
// shape or argument, else a cudaError_t. Pointers are device memory unless a comment says host; `stream` is a
// cudaStream_t. Weights are in the kernel layout [N/16, K/16, words] (kernels/dense.py prepare()); k2 = 2 * bits,
// codebook 0 3INST, 1 MCG, 2 MUL1.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// The x-ring GEMM's modes: the ring on mma.sync or on Hopper's wgmma, with one or two trellis groups per x chunk.
enum Exl3RingMode {
  EXL3_RING_MMA_1 = 81,
  EXL3_RING_MMA_2 = 82,
  EXL3_RING_WGMMA_1 = 91,
  EXL3_RING_WGMMA_2 = 92,
};

// ---- the library ------------------------------------------------------------------------------------------------
// The digest of kernels/abi.py's table that this library was built against (a library of another digest is refused).
const char* exl3_abi_digest(void);
const char* exl3_error_string(int code);
// 1 where programmatic launches are used at all (a PDL device and kernels built with the waits), else 0
int exl3_pdl_usable(void);
// The three-launch path's rotations and x-slice GEMMs as programmatic dependents (1) or plain launches (0), for every
// later launch of the process (the same bits either way); a negative value only asks. Returns the previous setting.
int exl3_set_plain_pdl(int on);
// 1 where this build has the wgmma ring kernels for the current GPU (compiled for sm_90a and running on it), else 0;
// below -1000: -1000 - a CUDA error. Runs a probe kernel and synchronizes: call it outside graph capture. The wgmma
// forms are refused until it has answered 1.
int exl3_wgmma_available(void);
// Host-side reading of a group table (host memory) as the kernels read it: out[0..6] = source of `item`, source of
// `col`, and that item's source's n_tiles, splits, x_row, item_begin, partial_base.
int exl3_group_probe(const void* table, int num, long long item, long long col, long long* out);

// ---- reconstruct and the rotations -------------------------------------------------------------------------------
// W_hat[:, column tiles tn0 .. tn0 + tn_count) as fp16 [K, ld]; bit-identical to the codec.
int exl3_reconstruct(const void* trellis, void* out, int k_tiles, int n_tiles, int tn0, int tn_count, int ld, int k2,
                     int codebook, void* stream);
// out fp16 [rows, cols] = had_r_128(x * suh); x fp16, or bf16 (x_bf16: rounded to fp16 as it is read)
int exl3_had_in(const void* x, int x_bf16, const void* suh, void* out, int rows, int cols, void* stream);
// out [rows, cols] = had_r_128(sum of `splits` partials acc [splits, rows, cols] (fp32, or fp16)) * svh; fp16, or bf16
// (out_bf16: the fp16 result rounded to bf16)
int exl3_had_out(const void* acc, int acc_is_fp32, const void* svh, void* out, int out_bf16, int splits, int rows,
                 int cols, void* stream);
// Pins the form of every later rotation launch (0: by size, 1: one warp per 128-block, 2: eight threads per
// 128-block; the same bits), for A/B measurements. Returns the previous form, or -3.
int exl3_set_had_form(int form);
// The size (128-blocks of one launch) from which form 0 takes eight threads per block; returns the previous one
long long exl3_set_octet_min_items(long long items);

// ---- dense linears -----------------------------------------------------------------------------------------------
// fp32 split-K partials [splits, m, N] of rotated fp16 xh [m, K] @ W_hat, m <= 64, x read from global memory
int exl3_gemm_partial(const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles, int splits,
                      int k2, int codebook, void* stream);
// the same partials, bit for bit, with x staged in shared memory per block (n_tiles % 4 == 0, at most 96 KB of x
// slice per block)
int exl3_gemm_partial_xs(const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                         int splits, int k2, int codebook, void* stream);
// the same partials for any m with x streamed through a shared-memory ring (n_tiles % 8 == 0; mode: Exl3RingMode;
// the mma.sync ring's partials are bit-identical at equal splits, the wgmma ring's within fp32 summation order)
int exl3_gemm_partial_ring(const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                           int splits, int k2, int codebook, int mode, void* stream);
// y [m, total_cols] for a same-input group of sources sharing bits and codebook (table: GroupSource[num]) in three
// launches; x and y fp16, or bf16 (x_bf16, y_bf16: the values of casting around an fp16 call). Scratch: xh_all fp16
// [num, m, K], partial fp32 [sum_s splits_s * N_s * m]. xs_slice > 0 (m <= 64): x staged in shared memory for K
// slices of up to xs_slice tiles; ring_mode (an Exl3RingMode; every source's N a multiple of 128): x through the ring
// instead; 0 and xs_slice 0: global loads. The partials are the same bit for bit.
int exl3_group_linear(const void* x, int x_bf16, const void* table, int num, void* xh_all, void* partial, void* out,
                      int y_bf16, int m, int k_tiles, int total_items, int total_cols, int k2, int codebook,
                      int xs_slice, int ring_mode, void* stream);
// exl3_group_linear on the wgmma ring in two launches for m <= 64, every source of the table at one K split: the
// input rotation, then the GEMM that rotates its output inside the launch (no partials). y is bit-identical to
// exl3_group_linear's on the wgmma ring over the same table.
int exl3_group_linear_rotating(const void* x, int x_bf16, const void* table, int num, void* xh_all, void* out,
                               int y_bf16, int m, int k_tiles, int total_items, int total_cols, int k2, int codebook,
                               void* stream);
// exl3_group_linear in one launch for m <= 16 (one source: a single linear): x and y both fp16 or both bf16. Every
// source's splits cut K into whole 128-blocks and its N is a multiple of 128 (the caller's table guarantees it).
// Scratch: partial fp32 [sum_s splits_s * N_s * m]; counters int32 [total_cols / 128], zero, and left zero. xs_slice:
// the longest K slice of any source, in tiles; pdl: launched as a programmatic dependent of the kernel before it.
// Bit-identical to exl3_group_linear at the same splits.
int exl3_linear_decode(const void* x, int bf16, const void* table, int num, void* partial, void* counters,
                       long long counters_len, void* out, int m, int k_tiles, int total_items, int total_cols, int k2,
                       int codebook, int xs_slice, int pdl, void* stream);

// ---- MoE ----------------------------------------------------------------------------------------------------------
// Every bank's rows of routed group tables in one launch (table: int64 [banks * pairs, 8], bank by bank; the banks
// of several groups, e.g. gate/up then down, each group's offsets starting at 0). `params` is host memory, 8 int64
// per bank: rows pointer, item0, col0, base0, items, cols, part, x_row_div. on_host = 1: the same code on host memory
// (tests).
int exl3_routed_tables(const long long* params, int banks, const void* ids, int ids_bytes, int pairs, void* table,
                       int on_host, void* stream);
// Every bank's rows of expert-sorted tables in one launch (table: int64 [banks * sources, 8], bank by bank). `params`
// is host memory, 6 int64 per bank: rows pointer, n_tiles, the items, the columns and the partial elements of the
// banks before it in its group (per filled tile, per tile and per tile), its K splits (1-1024). src_expert: int64
// [sources]; filled: one int64 (on_host = 1: host memory, the same code, for tests).
int exl3_sorted_tables(const long long* params, int banks, const void* src_expert, const void* filled, int sources,
                       int tile, void* table, int on_host, void* stream);
// The expert-sorted plan in one launch: ids int32/int64 [pairs]; rows int64 [pairs], src_expert int64 [sources],
// filled one int64 (on_host = 1: host memory, the host code).
int exl3_sorted_plan(const void* ids, int ids_bytes, int pairs, int experts, int tile, int sources, void* rows,
                     void* src_expert, void* filled, int on_host, void* stream);
// xs[rows[p]] = x[p / topk] for pairs p (x and xs of one 2-byte dtype, `hidden` a multiple of 8)
int exl3_sorted_gather(const void* x, const void* rows, int pairs, int topk, int hidden, void* xs, void* stream);
// out fp16 [sources * rows, n] = act(gate) * up for the fp16 [rows, 2 * sources * n] output of a two-bank group (silu,
// or gelu's tanh approximation when `gelu`), rows regrouped source by source
int exl3_act_mul(const void* gate_up, void* out, int sources, int rows, int n, int gelu, int on_host, void* stream);
// out fp32 [tokens, n] = the routing-weighted sum of each token's top-k rows of fp16 y; pair p's row starts at y +
// rows[p] (int64 element offsets; null: y + p * n); w fp32 [tokens * top-k]; pairs whose id is below 0 are skipped
int exl3_moe_combine(const void* y, const void* rows, const void* w, const void* ids, int ids_bytes, void* out,
                     int tokens, int topk, int n, int on_host, void* stream);
// A whole MoE forward over prepared tables in five launches (per-pair or expert-sorted sources): input rotation and
// GEMM of the 2S gate/up sources, moe_mid, the down GEMM, moe_tail. x fp16 or bf16 [*, H] as the gate/up table's
// x_row fields address it; out fp32 [tokens, H]. Scratch: xh_gu fp16 [2S, rows, H], partial_gu fp32 (the gate/up
// table's partials x rows), xh_dn fp16 [S, rows, I], partial_dn fp32 likewise.
int exl3_moe_fused(const void* x, int x_bf16, const void* gu_table, const void* dn_table, int sources, int rows,
                   int hidden, int inter, int gu_items, int dn_items, int gu_k2, int gu_codebook, int dn_k2,
                   int dn_codebook, void* xh_gu, void* partial_gu, void* xh_dn, void* partial_dn, const void* pair_rows,
                   const void* w, const void* ids, int ids_bytes, int tokens, int topk, int gelu, int gu_xs_slice,
                   int dn_xs_slice, void* out, void* stream);
// A whole MoE forward for one source per (token, expert) pair in two launches: x fp16 or bf16 [tokens, hidden];
// gate/up/down: bank rows (GroupSource layout, one per local expert); splits cut K into whole 128-blocks. Scratch:
// partial_gu fp32 [pairs * 2 * gu_splits * inter], xh_dn fp16 [pairs * inter], partial_dn fp32 [pairs * dn_splits *
// hidden], counters int32 [counters_len >= pairs * inter / 128 + tokens * hidden / 128], zero on entry and left zero.
// out: fp32, fp16 or bf16 (out_kind 0 / 1 / 2) [tokens, hidden]. Bit-identical to exl3_moe_fused at the same splits.
int exl3_moe_decode(const void* x, int x_bf16, const void* gate_rows, const void* up_rows, const void* down_rows,
                    const void* ids, int ids_bytes, const void* w, int tokens, int topk, int hidden, int inter,
                    int gu_k2, int gu_codebook, int dn_k2, int dn_codebook, int gu_splits, int dn_splits,
                    void* partial_gu, void* xh_dn, void* partial_dn, void* counters, long long counters_len,
                    int gelu, void* out, int out_kind, int pdl, void* stream);
// The rotated slab's glue: x fp16 or bf16 [pairs / top-k, k]; suh / svh fp16 [experts, width] in slab order; ids
// int32 / int64 [pairs]; a fp16 [2 * pairs, k], c fp16 [2 * pairs, n], h fp16 [pairs, n], y fp16 [pairs, hidden],
// w and out fp32
int exl3_slab_rot_in(const void* x, int x_bf16, const void* ids, int ids_bytes, int pairs, int topk,
                     const void* gate_suh, const void* up_suh, void* a, int k, void* stream);
int exl3_slab_mid(const void* c, const void* ids, int ids_bytes, int pairs, const void* gate_svh, const void* up_svh,
                  const void* down_suh, void* h, int n, int gelu, void* stream);
int exl3_slab_tail(const void* y, const void* ids, int ids_bytes, const void* w, const void* down_svh, void* out,
                   int tokens, int topk, int hidden, void* stream);

// ---- encoding ------------------------------------------------------------------------------------------------------
// states[t, 256] (int32, position order) of the tail-biting path of least squared error for tiles x[t, 256] (fp32,
// position order) against the codebook values `table` (fp32 [65536]); K in 1..8. Scratch: cost fp32
// [tiles, 2, 2^(16-K)], back uint16 [tiles, 256, 2^(16-K)].
int exl3_quantize_tiles(const void* x, const void* table, void* states, void* cost_scratch, void* back_scratch,
                        int tiles, int k, void* stream);
// The same states for K in 2..8 with codebook `cb` on at most `blocks` persistent blocks; snaps: fp32 scratch of
// exl3_quantize_tiles_fast_scratch(k) floats per block. tiles == 0 asks instead: *blocks_out = the blocks resident at
// once on the current device.
int exl3_quantize_tiles_fast(const void* x, void* states, void* snaps, int tiles, int k, int cb, int blocks,
                             int* blocks_out, void* stream);
long long exl3_quantize_tiles_fast_scratch(int k);

#ifdef __cplusplus
}  // extern "C"
#endif
