// EXL3 trellis kernels for sm_80+ (tuned on Hopper): bit-exact reconstruct, a fused decode GEMM for
// small m, and the Hadamard-128 rotations around it. Plain C ABI (loaded with ctypes), no torch headers.
//
// Decode layout. A 16x16 tile's 256 positions are stored in mma.m16n8k16 B-fragment order: lane t owns
// positions 8t..8t+7, which are (k, n) = (2(t%4) + {0,1} + 8{0,1}, t/4 + 8{0,1}). Read as the *A*
// operand of W^T (rows = output features, cols = k), the same positions are exactly lane t's A fragment:
// {p0,p1} = a0, {p4,p5} = a1, {p2,p3} = a2, {p6,p7} = a3. So each lane decodes its own 8 weights straight
// into registers and the activations become the 8-column B operand (swap AB): no shuffles, no shared
// memory, one mma per tile per 8 rows of x.
//
// Bit stream. With K2 = 2 * bits (bits may be x.5), a tile has 8*K2 int16 words; as little-endian
// uint32 they are the stream's 32-bit words MSB first (the int16 pair swap undoes itself). Position p's
// 16-bit state ends at bit floor((p+1)*K2/2) of a ring of 128*K2 bits. Lane t therefore needs bits
// [4t*K2 + K2/2 - 16, 4t*K2 + 4*K2) of the ring: two to four words, whose offsets are fixed per lane.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>
#include <vector>

namespace {

constexpr int kWarps = 4;  // warps per block in the GEMM and reconstruct kernels
constexpr int kDepth = 4;  // k-tiles per trellis load group in the GEMMs (double-buffered in registers)
constexpr float kRScale = 0.088388347648f;  // exllamav3's fp32 literal for 1/sqrt(128)

// ---- programmatic dependent launch (PDL) ---------------------------------------------------------
// A kernel launched as a programmatic dependent may start while the launch before it still runs; it must wait
// (griddepcontrol.wait: until that launch has finished and its writes are visible) before it reads anything an
// earlier launch wrote. Without the launch attribute the wait returns at once, so the same kernel serves both.

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches here may go as programmatic dependents: the device has PDL (compute capability 9.0+) and this
// library's kernels carry the waits (compiled from sm_90+ PTX). A build for an older arch that reaches a Hopper GPU
// as PTX has pdl_wait compiled out, and a dependent would read its predecessor's output before it is written.
__global__ void pdl_probe_kernel() {}
int pdl_usable() {
  static int usable = -1;  // once per process (one device arch per server process); a race only repeats the query
  if (usable < 0) {
    int dev = 0, major = 0;
    cudaFuncAttributes fa{};
    const bool queried = cudaGetDevice(&dev) == cudaSuccess &&
                         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                         cudaFuncGetAttributes(&fa, pdl_probe_kernel) == cudaSuccess;
    if (!queried) cudaGetLastError();  // a failed query (no device) leaves no error for the next launch's check
    usable = queried && major >= 9 && fa.ptxVersion >= 90;
  }
  return usable;
}

// kernel<<<grid, warps * 32, smem, stream>>>(args...), as a programmatic dependent of the launch before it when `pdl`
// and pdl_usable()
template <typename... Params, typename... Args>
int launch_ex(void (*kernel)(Params...), dim3 grid, int warps, int smem, bool pdl, cudaStream_t stream,
              Args... args) {
  pdl = pdl && pdl_usable();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(warps * 32);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = pdl ? attr : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  return (int)cudaLaunchKernelEx(&config, kernel, args...);
}

// The three-launch path's launches (the rotations and the x-slice GEMM, whose kernels wait before they read x or
// partials) go as programmatic dependents where exl3_set_plain_pdl turned that on: each is scheduled as the launch
// before it drains, so the gap between them shrinks, and the GEMM issues its first weight loads before its wait.
int g_plain_pdl = 0;
template <typename P>
using elem_t = std::remove_cv_t<std::remove_pointer_t<P>>;  // T of a T* (launch_plain's template arguments)
template <typename... Params, typename... Args>
void launch_plain(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t stream, Args... args) {
  launch_ex(kernel, grid, threads / 32, smem, g_plain_pdl != 0, stream, args...);  // errors: cudaGetLastError
}

// ---- compile-time geometry of one lane's bits --------------------------------------------------

__host__ __device__ constexpr int words32(int k2) { return 4 * k2; }
__host__ __device__ constexpr int rel_end(int k2, int j) { return ((j + 1) * k2) / 2 - k2 / 2; }  // state j ends at base + 16 + this
__host__ __device__ constexpr int span_bits(int k2) { return rel_end(k2, 7) + 16; }
__host__ __device__ constexpr int lane_base(int k2, int t) { return 4 * t * k2 + k2 / 2 - 16; }
__host__ __device__ constexpr int lane_off(int k2, int t) {
  return ((lane_base(k2, t) % 32) + 32) % 32;
}
// words a lane must load (max over lanes), and words holding its bits once shifted to offset 0
__host__ __device__ constexpr int load_words(int k2) {
  int most = 0;
  for (int t = 0; t < 32; ++t) {
    int w = (lane_off(k2, t) + span_bits(k2) + 31) / 32;
    most = w > most ? w : most;
  }
  return most;
}
__host__ __device__ constexpr int norm_words(int k2) { return (span_bits(k2) + 31) / 32; }
// K2 % 8 == 0 (4 and 8 bits): every lane's bits start at the same offset inside its first word, so each
// state's position in the loaded words is a constant and states can share 32-bit "views" (one funnel
// shift each, free when word-aligned) from which a state is one SHF or PRMT (offset 0, 8 or 16 in the view).
__host__ __device__ constexpr bool fixed_offset(int k2) { return k2 % 8 == 0; }
__host__ __device__ constexpr int abs_pos(int k2, int j) { return lane_off(k2, 0) + rel_end(k2, j); }
__host__ __device__ constexpr int view_start(int k2, int j) {
  int cur[8] = {-99, -99, -99, -99, -99, -99, -99, -99};  // open view per residue mod 8
  for (int i = 0; i <= j; ++i) {
    const int a = abs_pos(k2, i), r = a % 8;
    if (a - cur[r] > 16) {
      int aligned = (a / 32) * 32;  // a word-aligned view costs nothing
      cur[r] = (a - aligned == 0 || a - aligned == 8 || a - aligned == 16) ? aligned : a;
    }
  }
  return cur[abs_pos(k2, j) % 8];
}

// ---- codebooks ---------------------------------------------------------------------------------

template <int CB>
__device__ __forceinline__ uint32_t mix(uint32_t x) {
  if constexpr (CB == 0) return x * 89226354u + 64248484u;  // 3INST
  else if constexpr (CB == 1) return x * 0xCBAC1FEDu;       // MCG
  else return x * 0x83DCD12Du;                              // MUL1
}

// (x & 0x8FFF8FFF) ^ 0x3B603B60 as one lop3 (written in C, ptxas splits it in two: one immediate each)
__device__ __forceinline__ uint32_t mask_xor(uint32_t x) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(r) : "r"(x), "r"(0x8FFF8FFFu), "r"(0x3B603B60u));
  return r;
}

// Two 16-bit states -> half2 {value(a), value(b)}, bit-exact with exllamav3's decode_3inst_2.
template <int CB>
__device__ __forceinline__ uint32_t decode_pair(uint32_t a, uint32_t b) {
  a = mix<CB>(a);
  b = mix<CB>(b);
  half2 r;
  if constexpr (CB == 2) {
    uint32_t sa = __dp4a(a, 0x01010101u, 0x6400u);  // fp16 bits of 1024 + bytesum
    uint32_t sb = __dp4a(b, 0x01010101u, 0x6400u);
    uint32_t h = __byte_perm(sa, sb, 0x5410);
    const half2 k_inv = __halves2half2(__ushort_as_half(0x1EEE), __ushort_as_half(0x1EEE));
    const half2 k_bias = __halves2half2(__ushort_as_half(0xC931), __ushort_as_half(0xC931));
    r = __hfma2(*reinterpret_cast<half2*>(&h), k_inv, k_bias);
  } else {
    a = mask_xor(a);
    b = mask_xor(b);
    const half2 ha = *reinterpret_cast<half2*>(&a), hb = *reinterpret_cast<half2*>(&b);
    const half2 sa = __hadd2(__low2half2(ha), __high2half2(ha));  // {lo+hi, lo+hi}
    const half2 sb = __hadd2(__low2half2(hb), __high2half2(hb));
    r = __lows2half2(sa, sb);
  }
  return *reinterpret_cast<uint32_t*>(&r);
}

// ---- state extraction --------------------------------------------------------------------------

// 16 bits starting `pos` bits into the MSB-first buffer a[0..], zero-extended (pos is a constant).
template <int POS, int NW>
__device__ __forceinline__ uint32_t take16(const uint32_t (&a)[NW]) {
  constexpr int w = POS / 32, o = POS % 32;
  if constexpr (o == 0) return a[w] >> 16;
  else if constexpr (o == 8) return __byte_perm(a[w], 0u, 0x4421);
  else if constexpr (o == 16) return __byte_perm(a[w], 0u, 0x4410);
  else if constexpr (o < 16) return (a[w] >> (16 - o)) & 0xFFFFu;
  else return __funnelshift_r(a[w + 1], a[w], 48 - o) & 0xFFFFu;
}

// 32 bits starting S bits into the MSB-first words u[0..]
template <int S, int NW>
__device__ __forceinline__ uint32_t view32(const uint32_t (&u)[NW]) {
  constexpr int w = S / 32, r = S % 32;
  if constexpr (r == 0) return u[w];
  else if constexpr (w + 1 < NW) return __funnelshift_l(u[w + 1], u[w], r);
  else return u[w] << r;
}

// 16 bits at offset O in {0, 8, 16} of a view, zero-extended: one instruction
template <int O>
__device__ __forceinline__ uint32_t view_take16(uint32_t v) {
  static_assert(O == 0 || O == 8 || O == 16, "view offsets are byte-aligned and leave 16 bits");
  if constexpr (O == 0) return v >> 16;
  else if constexpr (O == 8) return __byte_perm(v, 0u, 0x4421);
  else return __byte_perm(v, 0u, 0x4410);
}

template <int K2, int J, int NW>
__device__ __forceinline__ uint32_t fixed_state(const uint32_t (&u)[NW]) {
  constexpr int s = view_start(K2, J);
  return view_take16<abs_pos(K2, J) - s>(view32<s, NW>(u));
}

template <int K2>
struct LaneBits {
  static constexpr int kLoad = load_words(K2);
  uint32_t idx[kLoad];  // word indexes inside the tile (ring order)
  int off;         // bit offset of the lane's first bit inside word idx[0]

  __device__ __forceinline__ explicit LaneBits(int lane) {
    int base = lane_base(K2, lane) + 128 * K2;  // ring: lane 0 starts before bit 0
    off = base & 31;
    int w0 = base >> 5;
#pragma unroll
    for (int i = 0; i < kLoad; ++i) idx[i] = (w0 + i) % words32(K2);
  }

  // u[i] = word idx[i] of the tile whose first word is base[tile_word]
  __device__ __forceinline__ void load(const uint32_t* __restrict__ base, uint32_t tile_word,
                                       uint32_t (&u)[kLoad]) const {
#pragma unroll
    for (int i = 0; i < kLoad; ++i) u[i] = __ldg(base + (tile_word + idx[i]));
  }

  // Lane's 8 weights as the 4 A-fragment registers {p0p1, p4p5, p2p3, p6p7}.
  template <int CB>
  __device__ __forceinline__ void decode(const uint32_t (&u)[kLoad], uint32_t (&frag)[4]) const {
    if constexpr (fixed_offset(K2)) {
      frag[0] = decode_pair<CB>(fixed_state<K2, 0>(u), fixed_state<K2, 1>(u));
      frag[1] = decode_pair<CB>(fixed_state<K2, 4>(u), fixed_state<K2, 5>(u));
      frag[2] = decode_pair<CB>(fixed_state<K2, 2>(u), fixed_state<K2, 3>(u));
      frag[3] = decode_pair<CB>(fixed_state<K2, 6>(u), fixed_state<K2, 7>(u));
    } else {
      decode_shifted<CB>(u, frag);
    }
  }

  // Lanes start at different bit offsets: shift the loaded words to offset 0 first (one funnel shift per word).
  template <int CB>
  __device__ __forceinline__ void decode_shifted(const uint32_t (&u)[kLoad], uint32_t (&frag)[4]) const {
    constexpr int kNorm = norm_words(K2);
    uint32_t a[kNorm];
#pragma unroll
    for (int i = 0; i < kNorm; ++i) {
      uint32_t next = i + 1 < kLoad ? u[i + 1] : 0u;
      a[i] = __funnelshift_l(next, u[i], off);  // off == 0 gives u[i]
    }
    uint32_t s0 = take16<rel_end(K2, 0), kNorm>(a), s1 = take16<rel_end(K2, 1), kNorm>(a);
    uint32_t s2 = take16<rel_end(K2, 2), kNorm>(a), s3 = take16<rel_end(K2, 3), kNorm>(a);
    uint32_t s4 = take16<rel_end(K2, 4), kNorm>(a), s5 = take16<rel_end(K2, 5), kNorm>(a);
    uint32_t s6 = take16<rel_end(K2, 6), kNorm>(a), s7 = take16<rel_end(K2, 7), kNorm>(a);
    frag[0] = decode_pair<CB>(s0, s1);
    frag[1] = decode_pair<CB>(s4, s5);
    frag[2] = decode_pair<CB>(s2, s3);
    frag[3] = decode_pair<CB>(s6, s7);
  }
};

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- reconstruct: W_hat fp16 [K, ld] (column tiles tn0 ..), from the kernel layout [N/16, K/16, words] --

template <int K2, int CB>
__global__ void __launch_bounds__(kWarps * 32) reconstruct_kernel(const uint32_t* __restrict__ trellis,
                                                                  half* __restrict__ out, int k_tiles, int n_tiles,
                                                                  int tn0, int tn_count, int ld) {
  __shared__ __align__(16) half stage[kWarps][16][24];  // rows padded to 48 B (16-byte aligned)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = blockIdx.x * kWarps + warp;
  if (tile >= k_tiles * tn_count) return;
  const int tk = tile / tn_count, tn_rel = tile % tn_count;
  LaneBits<K2> bits(lane);
  uint32_t u[LaneBits<K2>::kLoad], frag[4];
  bits.load(trellis, (uint32_t)((tn0 + tn_rel) * k_tiles + tk) * words32(K2), u);
  bits.template decode<CB>(u, frag);
  const int g = lane >> 2, r = 2 * (lane & 3);
  half(*s)[24] = stage[warp];
  const half2* f = reinterpret_cast<const half2*>(frag);
  s[r][g] = __low2half(f[0]);
  s[r + 1][g] = __high2half(f[0]);
  s[r][g + 8] = __low2half(f[1]);
  s[r + 1][g + 8] = __high2half(f[1]);
  s[r + 8][g] = __low2half(f[2]);
  s[r + 9][g] = __high2half(f[2]);
  s[r + 8][g + 8] = __low2half(f[3]);
  s[r + 9][g + 8] = __high2half(f[3]);
  __syncwarp();
  const int row = lane >> 1, half_col = (lane & 1) * 8;
  const uint4 v = *reinterpret_cast<const uint4*>(&s[row][half_col]);
  *reinterpret_cast<uint4*>(out + (size_t)(tk * 16 + row) * ld + tn_rel * 16 + half_col) = v;
}

// ---- reconstruct with the output rotation folded in: W' = W_hat H r diag(svh), fp16 [K, ld] -------------
// For large m the linear becomes had_in(x) @ W' in one cuBLAS GEMM: no output rotation over m x N outputs (86 us at
// m = 2048 on 4096x14336, ALU-bound on its shuffles) and no second pass over the GEMM output. Each block decodes a
// 64 x 128 piece of W_hat (4 x 8 tiles) into shared memory as fp32 and rotates its rows in two passes without
// shuffles: the Hadamard's stages commute, so each thread first transforms 16 consecutive elements (strides 1-8)
// in registers, then 8 elements 16 apart (strides 16-64), scales by r x svh and rounds once to fp16. fp32
// throughout; not bit-identical to the staged path (which rounds the GEMM output to fp16 before rotating it), within
// fp16 GEMM tolerance of the reference.
constexpr int kRotRows = 64;  // k rows per block
constexpr int kRotThreads = 256;
constexpr int kRotStride = 132;  // floats per shared row: 16-byte aligned rows, skewed banks

template <int N, int S>
__device__ __forceinline__ void butterfly_local(float (&v)[N]) {  // strides S, 2S, .. < N over v[0..N)
#pragma unroll
  for (int s = S; s < N; s <<= 1)
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (!(i & s)) {
        const float a = v[i], b = v[i + s];
        v[i] = a + b;
        v[i + s] = a - b;
      }
}

template <int K2, int CB>
__global__ void __launch_bounds__(kRotThreads) reconstruct_rot_out_kernel(const uint32_t* __restrict__ trellis,
                                                                         const half* __restrict__ svh,
                                                                         half* __restrict__ out, int k_tiles, int tn0,
                                                                         int ld) {
  __shared__ __align__(16) float w[kRotRows][kRotStride];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nb = blockIdx.x, kt0 = blockIdx.y * (kRotRows / 16);  // 128-column block (from tn0), first k tile
  const int rows = min(kRotRows, (k_tiles - kt0) * 16);
  const LaneBits<K2> bits(lane);
  const int g = lane >> 2, r = 2 * (lane & 3);
  for (int t = warp; t < (kRotRows / 16) * 8; t += kRotThreads / 32) {  // 4 k tiles x 8 column tiles
    const int tk = t >> 3, tn = t & 7;
    if (tk * 16 >= rows) break;
    uint32_t u[LaneBits<K2>::kLoad], frag[4];
    bits.load(trellis, (uint32_t)((tn0 + nb * 8 + tn) * k_tiles + kt0 + tk) * words32(K2), u);
    bits.template decode<CB>(u, frag);
    const half2* f = reinterpret_cast<const half2*>(frag);
    float* s = &w[tk * 16][tn * 16];
    s[r * kRotStride + g] = __low2float(f[0]);
    s[(r + 1) * kRotStride + g] = __high2float(f[0]);
    s[r * kRotStride + g + 8] = __low2float(f[1]);
    s[(r + 1) * kRotStride + g + 8] = __high2float(f[1]);
    s[(r + 8) * kRotStride + g] = __low2float(f[2]);
    s[(r + 9) * kRotStride + g] = __high2float(f[2]);
    s[(r + 8) * kRotStride + g + 8] = __low2float(f[3]);
    s[(r + 9) * kRotStride + g + 8] = __high2float(f[3]);
  }
  __syncthreads();
  for (int task = threadIdx.x; task < rows * 8; task += kRotThreads) {  // pass 1: 16 consecutive, strides 1-8
    float4* q = reinterpret_cast<float4*>(&w[task >> 3][(task & 7) * 16]);
    float v[16];
#pragma unroll
    for (int c = 0; c < 4; ++c) *reinterpret_cast<float4*>(&v[4 * c]) = q[c];
    butterfly_local<16, 1>(v);
#pragma unroll
    for (int c = 0; c < 4; ++c) q[c] = *reinterpret_cast<const float4*>(&v[4 * c]);
  }
  __syncthreads();
  for (int task = threadIdx.x; task < rows * 16; task += kRotThreads) {  // pass 2: 8 elements 16 apart
    const int row = task >> 4, j = task & 15;
    float v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = w[row][j + 16 * q];
    butterfly_local<8, 1>(v);
    half* o = out + (size_t)(kt0 * 16 + row) * ld + nb * 128 + j;
    const half* sv = svh + nb * 128 + j;
#pragma unroll
    for (int q = 0; q < 8; ++q) o[16 * q] = __float2half_rn(v[q] * kRScale * __half2float(sv[16 * q]));
  }
}

// ---- fused decode GEMM: partial[split, m, N] = xh[m, K-slice] @ W_hat[K-slice, N] -----------------
// Weights in the kernel layout [N/16, K/16, words] (tiles of one column strip contiguous; see prepare()).

// One warp's work item: column strip tn = item % n_tiles over K split item / n_tiles.
// B fragments of MT 8-row groups for one k16 tile from shared memory: ldmatrix .x2 (MT = 1) or one .x4 per 16
// rows; `addr` is this lane's address of the tile in rows 0-15 (see stage_x), `rows16` the bytes of 16 rows.
template <int MT>
__device__ __forceinline__ void ldsm_b(uint32_t addr, uint32_t rows16, uint32_t (&b)[MT][2]) {
  if constexpr (MT == 1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(b[0][0]), "=r"(b[0][1]) : "r"(addr));
  } else {
#pragma unroll
    for (int g = 0; g < MT / 2; ++g)
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(b[2 * g][0]), "=r"(b[2 * g][1]), "=r"(b[2 * g + 1][0]), "=r"(b[2 * g + 1][1])
                   : "r"(addr + g * rows16));
  }
}

// Rows of x staged per block: up to 16 rows, the m rows themselves (ldmatrix rows past m re-read row 0); above 16,
// whole 16-row groups with the rows past m zero (so one address per lane serves every group).
__host__ __device__ constexpr int xs_rows(int m, int mt) { return mt <= 2 ? (m < mt * 8 ? m : mt * 8) : mt * 8; }

// x rows [0, xs_rows) of the K-slice [kt0, kt1) into shared memory, row stride (kt1 - kt0) * 32 + 16 bytes (the
// 16-byte skew keeps ldmatrix's 8 row reads on distinct banks); all threads of the block take part. Returns this
// lane's ldmatrix address for the slice's first tile: row r = lane % 8 (+ 8 for lanes 16..31), k half = lane / 8 % 2;
// up to 16 rows, rows past m read row 0, as the global-memory path does (their C columns are never stored).
template <int MT>
__device__ __forceinline__ uint32_t stage_x(const half* __restrict__ xh, int m, int K, int kt0, int kt1,
                                            uint4* __restrict__ xs) {
  const int rows = xs_rows(m, MT);
  const int row16 = (kt1 - kt0) * 2, stride16 = row16 + 1;  // in 16-byte units
  for (int i = threadIdx.x; i < rows * row16; i += blockDim.x) {
    const int r = i / row16, c = i - r * row16;
    xs[r * stride16 + c] = r < m ? __ldg(reinterpret_cast<const uint4*>(xh + (size_t)r * K + kt0 * 16) + c)
                                 : make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int r = (lane & 7) + (MT >= 2 ? (lane >> 4) * 8 : 0);
  const int row = MT > 2 || r < m ? r : 0;
  return (uint32_t)__cvta_generic_to_shared(xs + row * stride16 + ((lane >> 3) & 1));
}

// stage_x once the launch that wrote x has finished: the x-slice GEMMs' stage callback, called after the warp's first
// weight loads are issued (as a programmatic dependent, launch_plain; a plain launch returns from the wait at once)
template <int MT>
__device__ __forceinline__ uint32_t wait_then_stage_x(const half* __restrict__ xh, int m, int K, int kt0, int kt1,
                                                      uint4* __restrict__ xs) {
  pdl_wait();
  return stage_x<MT>(xh, m, K, kt0, kt1, xs);
}

// A warp's accumulators into its partials: C fragment rows = output features g, g + 8 of the strip, columns = x rows
// 2tq, 2tq + 1 of each 8-row group; rows at or past m are not stored. `out` points at row 0 of the strip.
template <int MT>
__device__ __forceinline__ void store_acc(float* __restrict__ out, const float (&acc)[MT][4], int m, int N, int lane) {
  const int g = lane >> 2, tq = lane & 3;
  out += g;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r0 = mt * 8 + 2 * tq;
    if (r0 < m) {
      out[(size_t)r0 * N] = acc[mt][0];
      out[(size_t)r0 * N + 8] = acc[mt][2];
    }
    if (r0 + 1 < m) {
      out[(size_t)(r0 + 1) * N] = acc[mt][1];
      out[(size_t)(r0 + 1) * N + 8] = acc[mt][3];
    }
  }
}

// With XS, `stage(kt0, kt1)` fills the block's x slice and returns the lane's ldmatrix address (default: stage_x
// from xh); it runs after the first group's trellis loads are issued.
template <int K2, int CB, int MT, int DEPTH, bool XS = false, typename Stage = int>
__device__ __forceinline__ void gemm_warp(const half* __restrict__ xh, const uint32_t* __restrict__ trellis,
                                          float* __restrict__ partial, int m, int k_tiles, int n_tiles, int splits,
                                          int item, uint4* __restrict__ xs = nullptr, Stage stage = 0) {
  constexpr int L = LaneBits<K2>::kLoad;
  const int lane = threadIdx.x & 31;
  const int tn = item % n_tiles, split = item / n_tiles;
  const int kt0 = (int)((long long)split * k_tiles / splits), kt1 = (int)((long long)(split + 1) * k_tiles / splits);
  const int K = k_tiles * 16, N = n_tiles * 16;
  const int g = lane >> 2, tq = lane & 3;
  const LaneBits<K2> bits(lane);
  constexpr int W = words32(K2);
  // Kernel layout [n_tiles, k_tiles, W]: this warp's tiles are one contiguous stream, so the DEPTH tiles of
  // a group sit at immediate offsets d * W from one pointer per loaded word.
  const uint32_t* lw[L];
#pragma unroll
  for (int i = 0; i < L; ++i) lw[i] = trellis + ((size_t)tn * k_tiles + kt0) * W + bits.idx[i];

  // x rows of this lane for each 8-row group (B fragment: row g of the group, k = 2tq + {0,1} + 8{0,1})
  const uint32_t* xp[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int row = mt * 8 + g;
    xp[mt] = reinterpret_cast<const uint32_t*>(xh + (size_t)(row < m ? row : 0) * K + kt0 * 16) + tq;
  }

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

  // For m <= 16 the activation fragments of a group are loaded with its trellis words (they are L2 hits, but
  // loading them next to the mma stalled every tile on their latency); larger m loads them per tile. With XS the
  // block's x slice sits in shared memory and each tile's fragments are one ldmatrix, issued a group at a time.
  constexpr bool kPrefetchX = MT <= 2 && !XS;
  uint32_t xs_addr = 0;
  constexpr int XB = kPrefetchX ? MT : 1;
  auto load_tiles = [&](auto& buf, auto& xb, int count) {  // the next `count` tiles
#pragma unroll
    for (int d = 0; d < count; ++d) {
#pragma unroll
      for (int i = 0; i < L; ++i) buf[d][i] = __ldg(lw[i] + d * W);
      if constexpr (kPrefetchX) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          xb[d][mt][0] = __ldg(xp[mt] + d * 8);  // rows past m read row 0; their C columns are never stored
          xb[d][mt][1] = __ldg(xp[mt] + d * 8 + 4);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < L; ++i) lw[i] += count * W;
    if constexpr (kPrefetchX) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) xp[mt] += count * 8;
    }
  };
  auto compute_tiles = [&](const auto& buf, const auto& xb, int count) {
    if constexpr (XS) {
      constexpr int N = sizeof(buf) / sizeof(buf[0]);
      uint32_t bs[N][MT][2];
      const uint32_t rows16 = 16 * ((kt1 - kt0) * 32 + 16);
#pragma unroll
      for (int d = 0; d < count; ++d) ldsm_b<MT>(xs_addr + d * 32, rows16, bs[d]);
      xs_addr += count * 32;
#pragma unroll
      for (int d = 0; d < count; ++d) {
        uint32_t frag[4];
        bits.template decode<CB>(buf[d], frag);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma_16816(acc[mt], frag, bs[d][mt][0], bs[d][mt][1]);
      }
      return;
    }
#pragma unroll
    for (int d = 0; d < count; ++d) {
      uint32_t b0[MT], b1[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (kPrefetchX) {
          b0[mt] = xb[d][mt][0];
          b1[mt] = xb[d][mt][1];
        } else {
          b0[mt] = __ldg(xp[mt] + d * 8);
          b1[mt] = __ldg(xp[mt] + d * 8 + 4);
        }
      }
      uint32_t frag[4];
      bits.template decode<CB>(buf[d], frag);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_16816(acc[mt], frag, b0[mt], b1[mt]);
    }
    if constexpr (!kPrefetchX) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) xp[mt] += count * 8;
    }
  };

  // Groups of DEPTH tiles, ping-ponged between two register buffers: the next group's loads are issued
  // before the current group is decoded, so DEPTH tiles of latency hide behind the decode work.
  const int groups = (kt1 - kt0) / DEPTH;
  uint32_t buf_a[DEPTH][L], buf_b[DEPTH][L];
  uint32_t xb_a[DEPTH][XB][2], xb_b[DEPTH][XB][2];
  if (groups > 0) load_tiles(buf_a, xb_a, DEPTH);
  if constexpr (XS) {  // while the first group's words are in flight
    if constexpr (std::is_same_v<Stage, int>) xs_addr = stage_x<MT>(xh, m, K, kt0, kt1, xs);
    else xs_addr = stage(kt0, kt1);
  }
  for (int grp = 0; grp < groups; grp += 2) {
    if (grp + 1 < groups) load_tiles(buf_b, xb_b, DEPTH);
    compute_tiles(buf_a, xb_a, DEPTH);
    if (grp + 1 >= groups) break;
    if (grp + 2 < groups) load_tiles(buf_a, xb_a, DEPTH);
    compute_tiles(buf_b, xb_b, DEPTH);
  }
  for (int left = (kt1 - kt0) - groups * DEPTH; left > 0; --left) {  // fewer than DEPTH tiles
    uint32_t one[1][L], xone[1][XB][2];
    load_tiles(one, xone, 1);
    compute_tiles(one, xone, 1);
  }

  store_acc<MT>(partial + (size_t)split * m * N + tn * 16, acc, m, N, lane);
}

template <int K2, int CB, int MT, int DEPTH>
__global__ void __launch_bounds__(kWarps * 32) gemm_kernel(const half* __restrict__ xh,
                                                           const uint32_t* __restrict__ trellis,
                                                           float* __restrict__ partial, int m, int k_tiles,
                                                           int n_tiles, int splits) {
  const int item = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (item < n_tiles * splits) gemm_warp<K2, CB, MT, DEPTH>(xh, trellis, partial, m, k_tiles, n_tiles, splits, item);
}

// The same with the block's x slice staged in shared memory (m <= 64; the host guarantees n_tiles % kWarps == 0, so
// the block's warps share one K split and all of them reach stage_x's barrier).
template <int K2, int CB, int MT, int DEPTH>
__global__ void __launch_bounds__(kWarps * 32) gemm_xs_kernel(const half* __restrict__ xh,
                                                              const uint32_t* __restrict__ trellis,
                                                              float* __restrict__ partial, int m, int k_tiles,
                                                              int n_tiles, int splits) {
  extern __shared__ uint4 xs[];
  const int item = blockIdx.x * kWarps + (threadIdx.x >> 5);
  auto stage = [&](int kt0, int kt1) { return wait_then_stage_x<MT>(xh, m, k_tiles * 16, kt0, kt1, xs); };
  gemm_warp<K2, CB, MT, DEPTH, true>(xh, trellis, partial, m, k_tiles, n_tiles, splits, item, xs, stage);
}

// ---- the GEMM with x streamed through a shared-memory ring ------------------------------------------------
// gemm_xs_kernel stages a block's whole K slice of x before its first mma, so the slice (rows x K / splits) sets the
// split count: at 64 rows a 48 KB slice takes 12+ splits of 4096 x 14336, and the fp32 partials, the x traffic from
// L2 and the un-overlapped staging grow with m. Here x arrives in chunks of CG trellis groups (CG * kDepth k-tiles)
// through a ring of ring_stages(CG) slots filled by cp.async ahead of use, so the split count is free again and a
// block of KW warps reads each x chunk once for KW column strips. A block stages MT * 8 rows, zero past m. Rows
// beyond 64 are further 64-row blocks (blockIdx.y), each decoding the weights again. Per warp the k order is
// gemm_warp's, so the partials are the same bit for bit at equal splits.
constexpr int kRingMaxRows = 64;

__host__ __device__ constexpr int ring_stages(int cg) { return cg == 1 ? 3 : 2; }
__host__ __device__ constexpr int ring_row_bytes(int cg) { return cg * kDepth * 32 + 16; }  // a chunk row + skew
__host__ __device__ constexpr int ring_smem(int mt, int cg) { return ring_stages(cg) * mt * 8 * ring_row_bytes(cg); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {  // zero-fills past src_bytes
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// mma_16816 without `volatile`: a pure register operation, so the compiler may interleave it with the next tile's
// decode (the ring kernel's ldmatrix stays volatile: it must not move above the barrier that publishes its chunk).
__device__ __forceinline__ void mma_16816_free(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A lane's stream of trellis words down its column strip's K slice (kernel layout [n_tiles, k_tiles, W]: one
// contiguous run per strip): load(buf, count) reads the next `count` tiles' words at LaneBits' indexes into
// buf[0..count) (immediate offsets d * W from one pointer per word) and advances.
template <int K2>
struct TileStream {
  static constexpr int L = LaneBits<K2>::kLoad, W = words32(K2);
  const uint32_t* lw[L];

  __device__ __forceinline__ TileStream(const uint32_t* __restrict__ trellis, const LaneBits<K2>& bits, size_t tile0) {
#pragma unroll
    for (int i = 0; i < L; ++i) lw[i] = trellis + tile0 * W + bits.idx[i];
  }

  template <typename Buf>
  __device__ __forceinline__ void load(Buf& buf, int count) {
#pragma unroll
    for (int d = 0; d < count; ++d) {
#pragma unroll
      for (int i = 0; i < L; ++i) buf[d][i] = __ldg(lw[i] + d * W);
    }
#pragma unroll
    for (int i = 0; i < L; ++i) lw[i] += count * W;
  }
};

// This thread's share of the block's ring copies: a fixed 16-byte column c of the chunk and rows r0, r0 + step, ..
// (a pass of the block's threads covers `step` rows), so a chunk costs one add and one cp.async per piece.
template <int MT, int CG, int KW>
struct RingFill {
  static constexpr int kPerRow = CG * kDepth * 2;  // 16-byte pieces per row of a chunk
  static constexpr int kStep = KW * 32 / kPerRow;  // rows per pass of the block's threads
  static constexpr int kPasses = (MT * 8 + kStep - 1) / kStep;
  const half* src;  // row 0, column c, at the split's first tile
  uint32_t dst;     // offset of (r0, c) inside a slot
  int r0, tile;     // first row, and the k-tile of column c inside a chunk

  __device__ __forceinline__ RingFill(const half* __restrict__ xh, int kt0) {
    r0 = threadIdx.x / kPerRow;
    const int c = threadIdx.x % kPerRow;
    tile = c >> 1;
    src = xh + kt0 * 16 + c * 8;
    dst = r0 * ring_row_bytes(CG) + c * 16;
  }

  // chunk `chunk` (its tiles clipped to `tiles`, the split's length) into the slot at `slot`; rows >= m zero-filled
  // (their copies read nothing; the address given is row 0's)
  __device__ __forceinline__ void fill(uint32_t slot, int chunk, int tiles, int m, int K) const {
    if (chunk * CG * kDepth + tile >= tiles) return;
    const half* p = src + (size_t)chunk * CG * kDepth * 16;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = r0 + i * kStep;
      if (r >= MT * 8) break;
      cp_async16(slot + dst + i * kStep * ring_row_bytes(CG), r < m ? p + (size_t)r * K : p, r < m ? 16 : 0);
    }
  }
};

// One warp's work item (as gemm_warp's) for rows [64 blockIdx.y, +64) of x; every warp of the block shares the
// item's K split (n_tiles % KW == 0) and takes part in the ring's copies and barriers.
template <int K2, int CB, int MT, int KW, int CG>
__device__ __forceinline__ void ring_warp(const half* __restrict__ xh, const uint32_t* __restrict__ trellis,
                                          float* __restrict__ partial, int m, int k_tiles, int n_tiles, int splits,
                                          int item, uint4* __restrict__ ring) {
  constexpr int L = LaneBits<K2>::kLoad, D = kDepth, S = ring_stages(CG), RB = ring_row_bytes(CG);
  constexpr uint32_t slot_bytes = MT * 8 * RB, rows16 = 16 * RB;
  const int lane = threadIdx.x & 31;
  const int tn = item % n_tiles, split = item / n_tiles;
  const int kt0 = (int)((long long)split * k_tiles / splits), kt1 = (int)((long long)(split + 1) * k_tiles / splits);
  const int K = k_tiles * 16, N = n_tiles * 16;
  const int row0 = blockIdx.y * kRingMaxRows, mb = min(m - row0, kRingMaxRows);  // this block's rows
  const LaneBits<K2> bits(lane);
  const RingFill<MT, CG, KW> filler(xh + (size_t)row0 * K, kt0);

  TileStream<K2> words(trellis, bits, (size_t)tn * k_tiles + kt0);
  auto load_tiles = [&](auto& buf, int count) { words.load(buf, count); };

  // this lane's ldmatrix address in slot 0: row (lane % 8) (+ 8 for lanes 16..31), k half lane / 8 % 2
  const uint32_t ring0 = (uint32_t)__cvta_generic_to_shared(ring);
  const int r = (lane & 7) + (MT >= 2 ? (lane >> 4) * 8 : 0);
  const uint32_t lane_addr = ring0 + r * RB + ((lane >> 3) & 1) * 16;

  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
  auto compute_tiles = [&](const auto& buf, uint32_t addr, int count) {
    uint32_t b[2][MT][2];
    ldsm_b<MT>(addr, rows16, b[0]);
#pragma unroll
    for (int d = 0; d < count; ++d) {
      if (d + 1 < count) ldsm_b<MT>(addr + (d + 1) * 32, rows16, b[(d + 1) & 1]);
      uint32_t frag[4];
      bits.template decode<CB>(buf[d], frag);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_16816_free(acc[mt], frag, b[d & 1][mt][0], b[d & 1][mt][1]);
    }
  };

  const int tiles = kt1 - kt0, groups = tiles / D, chunks = (tiles + CG * D - 1) / (CG * D);
#pragma unroll
  for (int c = 0; c < S - 1; ++c) {
    if (c < chunks) filler.fill(ring0 + c * slot_bytes, c, tiles, mb, K);
    cp_async_commit();
  }
  // a chunk's first group waits for its x and refills the slot the previous chunk used; every group prefetches the
  // next group's trellis words, then computes
  auto chunk_start = [&](int c) {
    cp_async_wait<S - 2>();
    __syncthreads();
    if (c + S - 1 < chunks) filler.fill(ring0 + ((c + S - 1) % S) * slot_bytes, c + S - 1, tiles, mb, K);
    cp_async_commit();
  };
  auto step = [&](int grp, const auto& cur, auto& next) {
    if (grp % CG == 0) chunk_start(grp / CG);
    if (grp + 1 < groups) load_tiles(next, D);
    compute_tiles(cur, lane_addr + ((grp / CG) % S) * slot_bytes + (grp % CG) * D * 32, D);
  };
  uint32_t buf_a[D][L], buf_b[D][L];
  if (groups > 0) load_tiles(buf_a, D);
  for (int grp = 0; grp < groups; grp += 2) {
    step(grp, buf_a, buf_b);
    if (grp + 1 >= groups) break;
    step(grp + 1, buf_b, buf_a);
  }
  if (tiles > groups * D) {  // fewer than kDepth tiles after the last group, in the last chunk
    if (groups % CG == 0) {
      cp_async_wait<0>();
      __syncthreads();
    }
    const uint32_t addr = lane_addr + ((groups / CG) % S) * slot_bytes + (groups % CG) * D * 32;
    for (int d = 0; d < tiles - groups * D; ++d) {
      uint32_t one[1][L];
      load_tiles(one, 1);
      compute_tiles(one, addr + d * 32, 1);
    }
  }
  store_acc<MT>(partial + ((size_t)split * m + row0) * N + tn * 16, acc, mb, N, lane);
}

template <int K2, int CB, int MT, int KW, int CG>
__global__ void __launch_bounds__(KW * 32) gemm_ring_kernel(const half* __restrict__ xh,
                                                           const uint32_t* __restrict__ trellis,
                                                           float* __restrict__ partial, int m, int k_tiles,
                                                           int n_tiles, int splits) {
  extern __shared__ uint4 ring[];
  ring_warp<K2, CB, MT, KW, CG>(xh, trellis, partial, m, k_tiles, n_tiles, splits,
                                blockIdx.x * KW + (threadIdx.x >> 5), ring);
}


// ---- the x-ring GEMM on Hopper's warpgroup MMA (sm_90a) --------------------------------------------------------
// The ring GEMM at 64 rows spends ~40 of its ~86 warp instructions per tile on 8 mma.sync and 4 ldmatrix, and decodes
// the weights again per 64 rows. Here each warpgroup (4 warps = 4 column strips = 64 output features) issues one
// wgmma per k-tile and 64 rows of x: A = the decoded fragments, straight from registers (the wgmma A fragment of a
// warp's 16 rows is the mma.m16n8k16 A fragment), B = x^T from shared memory; a block of NR rows (16-256) decodes
// the weights once. wgmma is asynchronous: a trellis group's MMAs run while the next group is decoded.
//
// x arrives as in the ring (cp.async chunks of CG trellis groups), laid out as wgmma's K-major 128-byte-swizzled
// canonical layout: per 64 columns of K ("atom"), a row of x is 128 bytes whose 16-byte pieces are permuted by the
// row's low 3 bits (piece kk at kk ^ (row % 8)); rows 128 bytes apart (SBO = 1024 per 8 rows), atoms NR * 128 bytes
// apart; a k16 tile starts 32 bytes into its atom. (The unswizzled layout, 8x8 core matrices of 128 contiguous
// bytes, measured 0.74-0.88x the mma.sync ring at 8-64 rows and 3.8x bf16's time at 2,048; swizzled, 1.1-1.5x the
// ring at 64-256 rows: wgmma-ab.) Four slots; chunk c + 2 is copied while chunk c is read, so the slot being refilled
// was last read two chunks back, which every warp's wgmma has finished (each waits for all but its latest batch).
// Partials as the ring's ([splits, m, N] fp32); they measured equal to the mma.sync ring's bit for bit, but the
// tensor cores' summation order inside a k16 step is not specified, so the tests allow fp32 rounding.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EXL3_HAS_WGMMA 1
#endif

constexpr int kWgStages = 4;
__host__ __device__ constexpr int wg_slot_bytes(int nr, int cg) { return nr * cg * kDepth * 32; }
// + 1 KB to align the ring to the swizzle pattern's 1,024 bytes
__host__ __device__ constexpr int wg_smem(int nr, int cg) { return kWgStages * wg_slot_bytes(nr, cg) + 1024; }
inline bool wg_mode_ok(int mode) { return mode == 91 || mode == 92; }  // 9x: wgmma, x trellis groups per chunk
// rows of x per block (blockIdx.y): the wgmma N, 16 to 256
inline int wg_rows(int m) { return m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : m <= 128 ? 128 : 256; }

#define EXL3_ACC4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
template <int B, int MT>  // rows 8B .. 8B + 15 of the accumulators
__device__ __forceinline__ void wgmma_n16(float (&d)[MT][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7"
      "}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : EXL3_ACC4(d, B + 0), EXL3_ACC4(d, B + 1)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <int B, int MT>  // rows 8B .. 8B + 31 of the accumulators
__device__ __forceinline__ void wgmma_n32(float (&d)[MT][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : EXL3_ACC4(d, B + 0), EXL3_ACC4(d, B + 1), EXL3_ACC4(d, B + 2), EXL3_ACC4(d, B + 3)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <int B, int MT>  // rows 8B .. 8B + 63 of the accumulators
__device__ __forceinline__ void wgmma_n64(float (&d)[MT][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : EXL3_ACC4(d, B + 0), EXL3_ACC4(d, B + 1), EXL3_ACC4(d, B + 2), EXL3_ACC4(d, B + 3),
        EXL3_ACC4(d, B + 4), EXL3_ACC4(d, B + 5), EXL3_ACC4(d, B + 6), EXL3_ACC4(d, B + 7)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
#undef EXL3_ACC4

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async writes through the generic proxy, wgmma reads through the async proxy
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// keeps the compiler from touching accumulators across the asynchronous MMAs (CUTLASS's warpgroup_fence_operand)
template <int MT>
__device__ __forceinline__ void fence_acc(float (&acc)[MT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(acc[i][j])::"memory");
}

// acc[NR / 8][4] += W^T tile (a: this warp's 16 features) x x^T tile (desc: NR rows at the descriptor's address), as
// 64-row wgmmas (64 rows of x are 8 KB apart in an atom)
template <int NR>
__device__ __forceinline__ void wgmma_rows(float (&acc)[NR / 8][4], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (NR == 16) wgmma_n16<0>(acc, a, desc);
  else if constexpr (NR == 32) wgmma_n32<0>(acc, a, desc);
  else {
    wgmma_n64<0>(acc, a, desc);
    if constexpr (NR >= 128) wgmma_n64<8>(acc, a, desc + (8192 >> 4));
    if constexpr (NR >= 256) {
      wgmma_n64<16>(acc, a, desc + (16384 >> 4));
      wgmma_n64<24>(acc, a, desc + (24576 >> 4));
    }
  }
}

// This thread's share of a chunk's copies: 16-byte piece (kp, r) of the chunk (kp = 8-column K group, r = row) goes to
// atom kp / 8, row r, piece (kp % 8) ^ (r % 8); a warp's 32 pieces (8 rows x 4 K groups) hit 32 distinct banks groups
// four at a time.
template <int NR, int CG>
struct WgFill {
  static constexpr int kPieces = CG * kDepth * 2;   // 16-byte pieces per row of a chunk
  static constexpr int kRowStep = 256 / kPieces;    // rows per pass of the block's 256 threads
  static constexpr int kPasses = (NR * kPieces + 255) / 256;
  const half* src;  // row 0, piece kp, at the split's first tile
  uint32_t dst;     // (kp, r0) inside a slot
  int r0, tile;     // first row, and the k-tile of piece kp inside a chunk

  __device__ __forceinline__ WgFill(const half* __restrict__ xh, int kt0, int i) {  // i: this thread, 0..255
    const int kp = (i >> 3) % kPieces;
    r0 = (i & 7) + 8 * (i / (8 * kPieces));
    tile = kp >> 1;
    src = xh + kt0 * 16 + kp * 8;
    dst = (kp >> 3) * NR * 128 + r0 * 128 + (((kp & 7) ^ (r0 & 7)) << 4);  // kRowStep % 8 == 0: the same swizzle
  }

  // chunk `chunk` (its tiles clipped to `tiles`) into the slot at `slot`; rows >= mb zero-filled (their copies read
  // nothing; the address given is row 0's)
  __device__ __forceinline__ void fill(uint32_t slot, int chunk, int tiles, int mb, int K) const {
    if (chunk * CG * kDepth + tile >= tiles) return;
    const half* p = src + (size_t)chunk * CG * kDepth * 16;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = r0 + i * kRowStep;
      if (r >= NR) break;
      cp_async16(slot + dst + i * kRowStep * 128, r < mb ? p + (size_t)r * K : p, r < mb ? 16 : 0);
    }
  }
};

// One warp's work item (as ring_warp's) for rows [NR blockIdx.y, +NR) of x; the block's 8 warps (two warpgroups)
// share the item's K split (n_tiles % 8 == 0) and the x ring. kStage: the accumulators go to shared memory over the
// ring instead of to the partials, as [NR rows][128 columns] fp32 of the block's 8 strips (the cluster form).
template <int K2, int CB, int NR, int CG, bool kStage = false>
__device__ __forceinline__ void wg_warp(const half* __restrict__ xh, const uint32_t* __restrict__ trellis,
                                        float* __restrict__ partial, int m, int k_tiles, int n_tiles, int splits,
                                        int item, uint4* __restrict__ ring) {
#ifdef EXL3_HAS_WGMMA
  constexpr int L = LaneBits<K2>::kLoad, D = kDepth, S = kWgStages, P = S - 2;
  constexpr uint32_t slot_bytes = wg_slot_bytes(NR, CG), atom_bytes = NR * 128;
  const int lane = threadIdx.x & 31;
  const int tn = item % n_tiles, split = item / n_tiles;
  const int kt0 = (int)((long long)split * k_tiles / splits), kt1 = (int)((long long)(split + 1) * k_tiles / splits);
  const int K = k_tiles * 16, N = n_tiles * 16;
  const int row0 = blockIdx.y * NR, mb = min(m - row0, NR);
  const LaneBits<K2> bits(lane);
  const WgFill<NR, CG> filler(xh + (size_t)row0 * K, kt0, threadIdx.x);

  TileStream<K2> words(trellis, bits, (size_t)tn * k_tiles + kt0);
  auto load_tiles = [&](auto& buf, int count) { words.load(buf, count); };

  const uint32_t ring0 = ((uint32_t)__cvta_generic_to_shared(ring) + 1023u) & ~1023u;
  // descriptor: start address >> 4 (bits 0-13), LBO >> 4 (16-29; unused when swizzled: 1), SBO >> 4 (32-45),
  // 128-byte swizzle (bits 62-63 = 1)
  const uint64_t desc0 = (uint64_t)((ring0 & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) |
                         (1ull << 62);
  float acc[NR / 8][4];
#pragma unroll
  for (int i = 0; i < NR / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  fence_acc<NR / 8>(acc);
  // A trellis group's D tiles are decoded into one of two fragment sets, then MMA'd as one batch (one fence, D
  // wgmmas, one commit); waiting for the batch before it leaves the other set free for the next group's decode, so a
  // batch has a whole group's decode to finish in.
  uint32_t frag_a[D][4], frag_b[D][4];
  auto mma_batch = [&](auto& frag, uint32_t offset, int count) {
    wgmma_fence();
#pragma unroll
    for (int d = 0; d < count; ++d) wgmma_rows<NR>(acc, frag[d], desc0 + ((offset + d * 32) >> 4));
    wgmma_commit();
    wgmma_wait<1>();
  };

  const int tiles = kt1 - kt0, groups = tiles / D, chunks = (tiles + CG * D - 1) / (CG * D);
#pragma unroll
  for (int c = 0; c < P; ++c) {
    if (c < chunks) filler.fill(ring0 + c * slot_bytes, c, tiles, mb, K);
    cp_async_commit();
  }
  auto chunk_start = [&](int c) {
    cp_async_wait<P - 1>();
    fence_proxy_async();
    __syncthreads();
    if (c + P < chunks) filler.fill(ring0 + ((c + P) % S) * slot_bytes, c + P, tiles, mb, K);
    cp_async_commit();
  };
  auto step = [&](int grp, const auto& cur, auto& next, auto& frag) {
    if (grp + 1 < groups) load_tiles(next, D);
#pragma unroll
    for (int d = 0; d < D; ++d) bits.template decode<CB>(cur[d], frag[d]);
    if (grp % CG == 0) chunk_start(grp / CG);
    mma_batch(frag, ((grp / CG) % S) * slot_bytes + (grp % CG) * atom_bytes, D);
  };
  uint32_t buf_a[D][L], buf_b[D][L];
  if (groups > 0) load_tiles(buf_a, D);
  for (int grp = 0; grp < groups; grp += 2) {
    step(grp, buf_a, buf_b, frag_a);
    if (grp + 1 >= groups) break;
    step(grp + 1, buf_b, buf_a, frag_b);
  }
  if (tiles > groups * D) {  // fewer than kDepth tiles after the last group, in the last chunk
    if (groups % CG == 0) chunk_start(groups / CG);
    const uint32_t offset = ((groups / CG) % S) * slot_bytes + (groups % CG) * atom_bytes;
    wgmma_wait<0>();  // both fragment sets free
    for (int d = 0; d < tiles - groups * D; ++d) {
      uint32_t one[1][L];
      load_tiles(one, 1);
      bits.template decode<CB>(one[0], frag_a[0]);
      mma_batch(frag_a, offset + d * 32, 1);
      wgmma_wait<0>();
    }
  }
  wgmma_wait<0>();
  fence_acc<NR / 8>(acc);
  if constexpr (kStage) {
    static_assert(NR * 128 * 4 <= wg_smem(NR, CG) - 1024, "the staged accumulators must fit the ring");
    cp_async_wait<0>();
    __syncthreads();  // every warp's wgmmas have read their last chunk of the ring
    store_acc<NR / 8>(reinterpret_cast<float*>(ring) + (tn % 8) * 16, acc, mb, 128, lane);
  } else {
    store_acc<NR / 8>(partial + ((size_t)split * m + row0) * N + tn * 16, acc, mb, N, lane);
  }
#else
  __trap();  // the launcher checks exl3_wgmma_available() first
#endif
}

template <int K2, int CB, int NR, int CG>
__global__ void __launch_bounds__(256) gemm_wg_kernel(const half* __restrict__ xh, const uint32_t* __restrict__ trellis,
                                                      float* __restrict__ partial, int m, int k_tiles, int n_tiles,
                                                      int splits) {
  extern __shared__ uint4 ring[];
  wg_warp<K2, CB, NR, CG>(xh, trellis, partial, m, k_tiles, n_tiles, splits, blockIdx.x * 8 + (threadIdx.x >> 5),
                          ring);
}

// Writes 1 where this library's code for the running GPU has the wgmma kernels (built for sm_90a), else 0.
__global__ void wgmma_probe_kernel(int* out) {
#ifdef EXL3_HAS_WGMMA
  *out = 1;
#else
  *out = 0;
#endif
}

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

template <int K2, int CB, int MT, int DEPTH>
__global__ void __launch_bounds__(kWarps * 32) gemm_group_kernel(const half* __restrict__ xh_all,
                                                                 const GroupSource* __restrict__ srcs, int num,
                                                                 float* __restrict__ partial, int m, int k_tiles,
                                                                 int total_items) {
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * kWarps + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  gemm_warp<K2, CB, MT, DEPTH>(xh_all + (size_t)s * m * k_tiles * 16, src.tiles, partial + src.partial_base * m, m,
                               k_tiles, src.n_tiles, src.splits, local);
}

// The same with each block's x slice in shared memory (m <= 64). Every source's items are a multiple of kWarps
// (N % 128 == 0), so a block's warps share one source and one K split, and are all valid or all idle: the whole
// block returns together or reaches stage_x's barrier together.
template <int K2, int CB, int MT, int DEPTH>
__global__ void __launch_bounds__(kWarps * 32) gemm_group_xs_kernel(const half* __restrict__ xh_all,
                                                                    const GroupSource* __restrict__ srcs, int num,
                                                                    float* __restrict__ partial, int m, int k_tiles,
                                                                    int total_items) {
  extern __shared__ uint4 xs[];
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * kWarps + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  const half* xh = xh_all + (size_t)s * m * k_tiles * 16;
  auto stage = [&](int kt0, int kt1) { return wait_then_stage_x<MT>(xh, m, k_tiles * 16, kt0, kt1, xs); };
  gemm_warp<K2, CB, MT, DEPTH, true>(xh, src.tiles, partial + src.partial_base * m, m, k_tiles, src.n_tiles,
                                     src.splits, local, xs, stage);
}

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

__host__ __device__ __forceinline__ long long routed_id(const void* ids, int ids_bytes, long long p) {
  return ids_bytes == 4 ? (long long)((const int*)ids)[p] : ((const long long*)ids)[p];
}

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
// sizes a launch costs more than the work). fp32 math, as the torch reference computes it.
__host__ __device__ __forceinline__ float moe_act(float g, int gelu) {
  if (gelu) return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));  // tanh approx.
  return g / (1.f + expf(-g));                                                                      // silu
}

// gate_up: [rows, 2 * sources * n] as a two-bank group writes it (gate sources' columns, then up's); out: the
// activation in source-major rows [sources * rows, n], the row order of a down projection over the same sources.
__host__ __device__ __forceinline__ void act_mul_one(const half* __restrict__ gate_up, half* __restrict__ out,
                                                     int sources, int rows, int n, long long i, int gelu) {
  const long long c = i % n, r = (i / n) % rows, s = i / ((long long)n * rows);
  const long long at = r * 2 * sources * n + s * n + c, up = (long long)sources * n;
  out[i] = __float2half_rn(moe_act(__half2float(gate_up[at]), gelu) * __half2float(gate_up[at + up]));
}

__global__ void act_mul_kernel(const half* __restrict__ gate_up, half* __restrict__ out, int sources, int rows,
                               int n, long long count, int gelu) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) act_mul_one(gate_up, out, sources, rows, n, i, gelu);
}

// out[t, c] = sum over j < top-k, in order, of w[t, j] * y[row of pair t * top-k + j][c], skipping ids below 0.
// A pair's row starts at y + rows[p] (element offsets; null: y + p * n).
__host__ __device__ __forceinline__ void combine_one(const half* __restrict__ y, const long long* __restrict__ rows,
                                                     const float* __restrict__ w, const void* ids, int ids_bytes,
                                                     float* __restrict__ out, int topk, int n, long long i) {
  const long long t = i / n, c = i % n;
  float acc = 0.f;
  for (int j = 0; j < topk; ++j) {
    const long long p = t * topk + j;
    if (routed_id(ids, ids_bytes, p) >= 0) acc += w[p] * __half2float(y[(rows ? rows[p] : p * n) + c]);
  }
  out[i] = acc;
}

__global__ void combine_kernel(const half* __restrict__ y, const long long* __restrict__ rows,
                               const float* __restrict__ w, const void* ids, int ids_bytes, float* __restrict__ out,
                               int topk, int n, long long count) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) combine_one(y, rows, w, ids, ids_bytes, out, topk, n, i);
}

// ---- Hadamard-128 rotations (fp32 butterflies in exllamav3's stage order: bit-exact had_r_128) --

__device__ __forceinline__ void butterfly128(float (&v)[4], int lane) {
  float a = v[0], b = v[1], c = v[2], d = v[3];
  v[0] = a + b; v[1] = a - b; v[2] = c + d; v[3] = c - d;         // stride 1
  a = v[0]; b = v[1]; c = v[2]; d = v[3];
  v[0] = a + c; v[1] = b + d; v[2] = a - c; v[3] = b - d;         // stride 2
#pragma unroll
  for (int s = 1; s < 32; s <<= 1) {                               // strides 4 .. 64
    const bool upper = lane & s;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float p = __shfl_xor_sync(0xffffffffu, v[i], s);
      v[i] = upper ? p - v[i] : v[i] + p;
    }
  }
}

// fp16(r_scale * H(fp16(x * suh))) of one 128-block held in registers (lane: 4 consecutive elements of x and of
// suh, the latter as loaded: sv)
__device__ __forceinline__ void had_in_scaled(const half (&xp)[4], uint2 sv, half* __restrict__ out, int lane) {
  const half* sp = reinterpret_cast<const half*>(&sv);
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __half2float(__float2half_rn(__half2float(xp[i]) * __half2float(sp[i])));
  butterfly128(v, lane);
  uint2 o;
  half* op = reinterpret_cast<half*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) op[i] = __float2half_rn(v[i] * kRScale);
  *reinterpret_cast<uint2*>(out + lane * 4) = o;
}
__device__ __forceinline__ void had_in_values(const half (&xp)[4], const half* __restrict__ suh,
                                              half* __restrict__ out, int lane) {
  had_in_scaled(xp, *reinterpret_cast<const uint2*>(suh + lane * 4), out, lane);
}

// 4 consecutive inputs as fp16: bf16 is rounded to fp16 first, exactly what casting x to fp16 beforehand does
__device__ __forceinline__ void load4_fp16(const half* __restrict__ x, half (&v)[4]) {
  const uint2 xv = *reinterpret_cast<const uint2*>(x);
  const half* xp = reinterpret_cast<const half*>(&xv);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = xp[i];
}
__device__ __forceinline__ void load4_fp16(const __nv_bfloat16* __restrict__ x, half (&v)[4]) {
  const uint2 xv = *reinterpret_cast<const uint2*>(x);
  const __nv_bfloat16* xp = reinterpret_cast<const __nv_bfloat16*>(&xv);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = __float2half_rn(__bfloat162float(xp[i]));
}

template <typename T>
__device__ __forceinline__ void had_in_block(const T* __restrict__ x, const half* __restrict__ suh,
                                             half* __restrict__ out, int lane) {
  half v[4];
  load4_fp16(x + lane * 4, v);
  had_in_values(v, suh, out, lane);
}

// fp16(fp16(r_scale * H(sum_s acc[s])) * svh) of one 128-block into registers (lane: 4 consecutive elements);
// acc points at split 0, splits split_stride apart
template <bool kCG, typename T>
__device__ __forceinline__ float load_acc(const T* p) {
  if constexpr (kCG) return __ldcg(p);  // fp32 only: written by another block of this launch, read past L1
  else return (float)*p;
}

// fp16(fp16(r_scale * H(v)) * svh) of one 128-block whose split sum v the lane holds (4 consecutive elements)
__device__ __forceinline__ void had_out_finish(float (&v)[4], const half* __restrict__ svh, int lane, half (&op)[4]) {
  butterfly128(v, lane);
  const uint2 sv = *reinterpret_cast<const uint2*>(svh + lane * 4);
  const half* sp = reinterpret_cast<const half*>(&sv);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    op[i] = __float2half_rn(__half2float(__float2half_rn(v[i] * kRScale)) * __half2float(sp[i]));
}

template <typename T, bool kCG = false>
__device__ __forceinline__ void had_out_values(const T* __restrict__ acc, size_t split_stride, int splits,
                                               const half* __restrict__ svh, int lane, half (&op)[4]) {
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  const T* p = acc + lane * 4;
  int s = 0;
  for (; s + 8 <= splits; s += 8) {  // eight loads in flight: a serial chain of L2 latencies cost up to 16 us
    float t[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) t[j][i] = load_acc<kCG>(p + (s + j) * split_stride + i);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] += t[j][i];  // same order as one split at a time: deterministic
  }
  if (s < splits) {  // the last (< 8) splits: every load issued before the first add, summed in the same order
    float t[7][4];
#pragma unroll
    for (int j = 0; j < 7; ++j)
      if (s + j < splits)
#pragma unroll
        for (int i = 0; i < 4; ++i) t[j][i] = load_acc<kCG>(p + (s + j) * split_stride + i);
#pragma unroll
    for (int j = 0; j < 7; ++j)
      if (s + j < splits)
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] += t[j][i];
  }
  had_out_finish(v, svh, lane, op);
}

// 4 consecutive fp16 outputs stored as fp16, or rounded to bf16: exactly what casting the fp16 output afterwards does
__device__ __forceinline__ void store4(half* __restrict__ out, const half (&v)[4]) {
  *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(v);
}
__device__ __forceinline__ void store4(__nv_bfloat16* __restrict__ out, const half (&v)[4]) {
  uint2 o;
  __nv_bfloat16* op = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) op[i] = __float2bfloat16_rn(__half2float(v[i]));
  *reinterpret_cast<uint2*>(out) = o;
}

template <typename T, typename O>
__device__ __forceinline__ void had_out_block(const T* __restrict__ acc, size_t split_stride, int splits,
                                              const half* __restrict__ svh, O* __restrict__ out, int lane) {
  half op[4];
  had_out_values(acc, split_stride, splits, svh, lane, op);
  store4(out + lane * 4, op);
}

// out[r, :] = fp16(r_scale * H(fp16(x[r, :] * suh)))  (x fp16 or bf16, out fp16 [rows, cols]; one warp per 128 block)
template <typename T>
__global__ void had_in_kernel(const T* __restrict__ x, const half* __restrict__ suh, half* __restrict__ out,
                              int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int blocks = cols / 128;
  if (item >= rows * blocks) return;
  const size_t at = (size_t)(item / blocks) * cols + (item % blocks) * 128;
  had_in_block(x + at, suh + (item % blocks) * 128, out + at, threadIdx.x & 31);
}

// out[r, :] = fp16(fp16(r_scale * H(sum_s acc[s, r, :])) * svh)   (acc fp32 or fp16 [splits, rows, cols]; out fp16,
// or bf16 rounded from that fp16)
template <typename T, typename O>
__global__ void had_out_kernel(const T* __restrict__ acc, const half* __restrict__ svh, O* __restrict__ out,
                               int splits, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int blocks = cols / 128;
  if (item >= rows * blocks) return;
  const int c0 = (item % blocks) * 128;
  const size_t at = (size_t)(item / blocks) * cols + c0;
  had_out_block(acc + at, (size_t)rows * cols, splits, svh + c0, out + at, threadIdx.x & 31);
}

// Group: xh_all[s, r, :] = had_in(x[x_row_s + r, :], suh_s) for every source s
template <typename T>
__global__ void had_in_group_kernel(const T* __restrict__ x, const GroupSource* __restrict__ srcs, int num,
                                    half* __restrict__ xh_all, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int blocks = cols / 128, per_source = rows * blocks;
  if (item >= num * per_source) return;
  const int s = item / per_source, r = (item % per_source) / blocks, c0 = (item % blocks) * 128;
  if (srcs[s].n_tiles == 0) return;  // empty source
  had_in_block(x + (size_t)(srcs[s].x_row + r) * cols + c0, srcs[s].suh + c0,
               xh_all + ((size_t)s * rows + r) * cols + c0, threadIdx.x & 31);
}

// Group: out[r, col_begin_s + c] = had_out of source s's partials, for the concatenated output [rows, total_cols]
// (fp16, or bf16 rounded from it)
template <typename O>
__global__ void had_out_group_kernel(const float* __restrict__ partial, const GroupSource* __restrict__ srcs, int num,
                                     O* __restrict__ out, int rows, int total_cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int blocks = total_cols / 128;
  if (item >= rows * blocks) return;
  const int r = item / blocks, col = (item % blocks) * 128;
  const int s = group_source_at<true>(srcs, num, col);
  const GroupSource& src = srcs[s];
  const int n = src.n_tiles * 16, c0 = col - (int)src.col_begin;
  if (c0 >= n) return;  // an empty source's columns are never read
  const float* acc = partial + src.partial_base * rows + (size_t)r * n + c0;
  had_out_block(acc, (size_t)rows * n, src.splits, src.svh + c0, out + (size_t)r * total_cols + col,
                threadIdx.x & 31);
}

// ---- the rotations at eight threads per 128-block ("octet" form) ---------------------------------------------
// The one-warp form above runs five shuffle stages over 4 values per lane and is ALU-bound at large m (85.6 us for
// had_out at 2048 x 14336, 29 M outputs). Here eight threads of a warp rotate one 128-block: thread t holds the
// 16 consecutive values 16t..16t+15, so strides 1-8 run in registers; strides 16-64 run after one shared-memory
// transpose (thread t then holds columns 2t, 2t+1 of all eight 16-value chunks); a second transpose brings the
// values home for 16-byte stores. Every fp32 operation of butterfly128 runs in the same stage order (lower + upper,
// lower - upper), so the two forms give the same bits.
constexpr int kOctetChunk = 20;                  // floats per 16-value chunk in shared memory: conflict-free float4
constexpr int kOctetStride = 8 * kOctetChunk + 16;  // floats per 128-block: 176 (two blocks in a half-warp differ by 16 banks)
constexpr int kOctetItems = 32;                  // 128-blocks per 256-thread block

// Hadamard-128 (unscaled) of the block held by the octet: v = this thread's 16 consecutive values; sm = the block's
// kOctetStride floats; t = thread within the octet. Every lane of the warp must call it (it syncs the warp).
__device__ __forceinline__ void octet_butterfly(float (&v)[16], float* __restrict__ sm, int t) {
  butterfly_local<16, 1>(v);  // strides 1, 2, 4, 8
  float4* own = reinterpret_cast<float4*>(sm + t * kOctetChunk);
#pragma unroll
  for (int q = 0; q < 4; ++q) own[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
  __syncwarp();
  float a[8], b[8];  // columns 2t and 2t + 1 of chunks 0..7
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    const float2 p = *reinterpret_cast<const float2*>(sm + g * kOctetChunk + 2 * t);
    a[g] = p.x;
    b[g] = p.y;
  }
  butterfly_local<8, 1>(a);  // strides 16, 32, 64
  butterfly_local<8, 1>(b);
  __syncwarp();
#pragma unroll
  for (int g = 0; g < 8; ++g) *reinterpret_cast<float2*>(sm + g * kOctetChunk + 2 * t) = make_float2(a[g], b[g]);
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 p = own[q];
    v[4 * q] = p.x; v[4 * q + 1] = p.y; v[4 * q + 2] = p.z; v[4 * q + 3] = p.w;
  }
}

// 16 consecutive fp16 values (bf16 rounded to fp16 as read, as load4_fp16 does), as floats
__device__ __forceinline__ void load16_fp16(const half* __restrict__ x, half (&h)[16]) {
  const uint4* p = reinterpret_cast<const uint4*>(x);
  *reinterpret_cast<uint4*>(&h[0]) = p[0];
  *reinterpret_cast<uint4*>(&h[8]) = p[1];
}
__device__ __forceinline__ void load16_fp16(const __nv_bfloat16* __restrict__ x, half (&h)[16]) {
  const uint4* p = reinterpret_cast<const uint4*>(x);
  uint4 raw[2] = {p[0], p[1]};
  const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) h[i] = __float2half_rn(__bfloat162float(b[i]));
}

// 16 consecutive partial values of one split, as floats (fp32 partials of this launch's GEMM: read past L1)
__device__ __forceinline__ void load16_acc(const float* __restrict__ p, float (&t)[16]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 w = __ldcg(reinterpret_cast<const float4*>(p) + q);
    t[4 * q] = w.x; t[4 * q + 1] = w.y; t[4 * q + 2] = w.z; t[4 * q + 3] = w.w;
  }
}
__device__ __forceinline__ void load16_acc(const half* __restrict__ p, float (&t)[16]) {
  half h[16];
  load16_fp16(p, h);
#pragma unroll
  for (int i = 0; i < 16; ++i) t[i] = __half2float(h[i]);
}

__device__ __forceinline__ void store16(half* __restrict__ out, const half (&h)[16]) {
  uint4* p = reinterpret_cast<uint4*>(out);
  p[0] = *reinterpret_cast<const uint4*>(&h[0]);
  p[1] = *reinterpret_cast<const uint4*>(&h[8]);
}
__device__ __forceinline__ void store16(__nv_bfloat16* __restrict__ out, const half (&h)[16]) {
  uint4 raw[2];
  __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) b[i] = __float2bfloat16_rn(__half2float(h[i]));
  uint4* p = reinterpret_cast<uint4*>(out);
  p[0] = raw[0];
  p[1] = raw[1];
}

// had_in of one block by an octet (valid: this octet has a block; others still join the warp's syncs)
template <typename T>
__device__ __forceinline__ void had_in_octet(const T* __restrict__ x, const half* __restrict__ suh,
                                             half* __restrict__ out, bool valid, float* __restrict__ sm, int t) {
  float v[16];
  if (valid) {
    half h[16], s[16];
    load16_fp16(x + 16 * t, h);
    load16_fp16(suh + 16 * t, s);
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = __half2float(__float2half_rn(__half2float(h[i]) * __half2float(s[i])));
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = 0.f;
  }
  octet_butterfly(v, sm, t);
  if (!valid) return;
  half o[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) o[i] = __float2half_rn(v[i] * kRScale);
  store16(out + 16 * t, o);
}

// had_out of one block by an octet: the splits summed in order, rotated, scaled, * svh. fp32 partials are loaded
// two splits at a time; fp16 (one split: reconstruct + cuBLAS) one at a time, which keeps the kernel near 48
// registers, so enough threads are resident to keep the loads of a bandwidth-bound launch in flight
template <typename T, typename O>
__device__ __forceinline__ void had_out_octet(const T* __restrict__ acc, size_t split_stride, int splits,
                                              const half* __restrict__ svh, O* __restrict__ out, bool valid,
                                              float* __restrict__ sm, int t) {
  constexpr int kBatch = std::is_same<T, float>::value ? 2 : 1;
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = 0.f;
  if (valid) {
    const T* p = acc + 16 * t;
    for (int s = 0; s < splits; s += kBatch) {
      float w[kBatch][16];
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (s + j < splits) load16_acc(p + (s + j) * split_stride, w[j]);
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (s + j < splits)
#pragma unroll
          for (int i = 0; i < 16; ++i) v[i] += w[j][i];  // split order, as had_out_values
    }
  }
  octet_butterfly(v, sm, t);
  if (!valid) return;
  half sv[16], o[16];
  load16_fp16(svh + 16 * t, sv);
#pragma unroll
  for (int i = 0; i < 16; ++i)
    o[i] = __float2half_rn(__half2float(__float2half_rn(v[i] * kRScale)) * __half2float(sv[i]));
  store16(out + 16 * t, o);
}

// The octet's block index and thread within it, and its slice of the block's shared memory
struct Octet {
  long long item;
  int t;
  float* sm;
};
__device__ __forceinline__ Octet octet_here() {
  __shared__ __align__(16) float sm_all[kOctetItems * kOctetStride];
  const int o = threadIdx.x >> 3;
  return {(long long)blockIdx.x * kOctetItems + o, (int)(threadIdx.x & 7), sm_all + o * kOctetStride};
}

// Where block `item` of a dense [rows, cols] launch lies: its first column and element offset (0 past the end)
struct OctetBlock {
  bool valid;
  int c0;
  size_t at;
};
__device__ __forceinline__ OctetBlock octet_block(long long item, int rows, int cols) {
  const int blocks = cols / 128;
  if (item >= (long long)rows * blocks) return {false, 0, 0};
  const long long r = item / blocks;
  const int c0 = (int)(item - r * blocks) * 128;
  return {true, c0, (size_t)r * cols + c0};
}

template <typename T>
__global__ void __launch_bounds__(256) had_in_octet_kernel(const T* __restrict__ x, const half* __restrict__ suh,
                                                           half* __restrict__ out, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const Octet o = octet_here();
  const OctetBlock b = octet_block(o.item, rows, cols);
  had_in_octet(x + b.at, suh + b.c0, out + b.at, b.valid, o.sm, o.t);
}

template <typename T, typename O>
__global__ void __launch_bounds__(256) had_out_octet_kernel(const T* __restrict__ acc, const half* __restrict__ svh,
                                                            O* __restrict__ out, int splits, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const Octet o = octet_here();
  const OctetBlock b = octet_block(o.item, rows, cols);
  had_out_octet(acc + b.at, (size_t)rows * cols, splits, svh + b.c0, out + b.at, b.valid, o.sm, o.t);
}

template <typename T>
__global__ void __launch_bounds__(256) had_in_group_octet_kernel(const T* __restrict__ x,
                                                                 const GroupSource* __restrict__ srcs, int num,
                                                                 half* __restrict__ xh_all, int rows, int cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const Octet o = octet_here();
  const OctetBlock b = octet_block(o.item, num * rows, cols);  // xh_all is [num * rows, cols]
  const long long row = (long long)(b.at / cols);
  const int s = (int)(row / rows), r = (int)(row % rows);
  const bool valid = b.valid && srcs[s].n_tiles != 0;  // not an empty source
  had_in_octet(x + (size_t)(valid ? srcs[s].x_row + r : 0) * cols + b.c0, valid ? srcs[s].suh + b.c0 : nullptr,
               xh_all + b.at, valid, o.sm, o.t);
}

template <typename O>
__global__ void __launch_bounds__(256) had_out_group_octet_kernel(const float* __restrict__ partial,
                                                                  const GroupSource* __restrict__ srcs, int num,
                                                                  O* __restrict__ out, int rows, int total_cols) {
  pdl_wait();  // x or partials come from the launch before (launch_plain)
  const Octet o = octet_here();
  const int blocks = total_cols / 128;
  bool valid = o.item < (long long)rows * blocks;
  const int r = valid ? (int)(o.item / blocks) : 0, col = valid ? (int)(o.item % blocks) * 128 : 0;
  const int s = group_source_at<true>(srcs, num, col);
  const GroupSource& src = srcs[s];
  const int n = src.n_tiles * 16, c0 = col - (int)src.col_begin;
  valid = valid && c0 < n;  // an empty source's columns are never read
  const float* acc = partial + src.partial_base * rows + (size_t)r * n + c0;
  had_out_octet(acc, (size_t)rows * n, src.splits, src.svh + (valid ? c0 : 0),
                out + (size_t)r * total_cols + col, valid, o.sm, o.t);
}

// Which form a rotation launch takes: kHadFormAuto picks the octet form from g_octet_min_items 128-blocks (the
// Python side sets the measured crossover when it loads the library), except over fp32 split-K partials, where the
// warp form's eight loads in flight per lane measured faster at every size (rotation-ab); exl3_set_had_form pins
// one form for the whole process (A/B measurements)
constexpr int kHadFormAuto = 0, kHadFormWarp = 1, kHadFormOctet = 2;
int g_had_form = kHadFormAuto;
long long g_octet_min_items = 4096;
bool use_octet(long long items, bool fp32_partials) {
  if (g_had_form != kHadFormAuto) return g_had_form == kHadFormOctet;
  return !fp32_partials && items >= g_octet_min_items;
}
unsigned octet_grid(long long items) { return (unsigned)((items + kOctetItems - 1) / kOctetItems); }

// xh_all[s, r, :] = had_in(x[x_row_s + r, :], suh_s) for every source s, in the form the size picks
template <typename T>
void launch_had_in_group(const T* x, const GroupSource* srcs, int num, half* xh_all, int rows, int cols,
                         cudaStream_t s) {
  const long long items = (long long)num * rows * (cols / 128);
  if (use_octet(items, false))
    launch_plain(had_in_group_octet_kernel<T>, dim3(octet_grid(items)), 256, 0, s, x, srcs, num, xh_all, rows, cols);
  else
    launch_plain(had_in_group_kernel<T>, dim3((unsigned)((items + 7) / 8)), 256, 0, s, x, srcs, num, xh_all, rows,
                 cols);
}

// ---- fused MoE stages: the glue between the grouped GEMMs folded into their rotations ------------------
// Sources of a MoE forward: S gate sources, then S up sources in one table (gu), S down sources in another (dn),
// each source `rows` rows (per-pair: rows = 1, source p = pair p; sorted: a tile of rows). Source s's rows of the
// activation are the down projection's rows s * rows + r. moe_mid: per (source, row, 128 columns) a pair of warps
// rotates gate's and up's partials (one each, in parallel), then the gate warp applies the activation and rotates
// the result into the down projection's input: output rotation, act_mul and input rotation in one launch, with
// every fp16 rounding of the unfused path.
constexpr int kMidItems = 4;  // (source, row, block) items per moe_mid block: 2 warps each

__global__ void __launch_bounds__(2 * kMidItems * 32) moe_mid_kernel(
    const float* __restrict__ partial, const GroupSource* __restrict__ gu, const GroupSource* __restrict__ dn,
    int sources, int rows, int n, half* __restrict__ xh_dn, int gelu) {
  __shared__ uint2 up_vals[kMidItems][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slot = warp >> 1, role = warp & 1;
  const int item = blockIdx.x * kMidItems + slot;
  const int blocks = n / 128, per_source = rows * blocks;
  const int s = item / per_source, r = (item % per_source) / blocks, c0 = (item % blocks) * 128;
  // empty sources (sorted tables) and the grid's tail do nothing, but still reach the barrier
  const bool live = item < sources * per_source && gu[s].n_tiles != 0;
  half v[4];
  if (live) {
    const GroupSource& src = gu[role * sources + s];
    had_out_values(partial + src.partial_base * rows + (size_t)r * n + c0, (size_t)rows * n, src.splits,
                   src.svh + c0, lane, v);
    if (role == 1) up_vals[slot][lane] = *reinterpret_cast<const uint2*>(v);
  }
  __syncthreads();
  if (!live || role == 1) return;
  const uint2 uw = up_vals[slot][lane];
  const half* uv = reinterpret_cast<const half*>(&uw);
  half a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = __float2half_rn(moe_act(__half2float(v[i]), gelu) * __half2float(uv[i]));
  had_in_values(a, dn[s].suh + c0, xh_dn + ((size_t)s * rows + r) * n + c0, lane);
}

// moe_tail: out[t, c] (fp32) = sum over j < top-k, in order, of w[p] * y_p[c], p = t * top-k + j, ids below 0
// skipped, where y_p is pair p's row of the down projection rotated here from its partials: output rotation and
// combine in one launch. One block per (token, 128 columns), its warps rotate the top-k rows in parallel, one warp
// sums them in order. Pair p's row is q = pair_rows[p] (null: p): source q / rows, row q % rows.
constexpr int kMaxFusedTopk = 32;

__global__ void __launch_bounds__(256) moe_tail_kernel(
    const float* __restrict__ partial, const GroupSource* __restrict__ dn, const long long* __restrict__ pair_rows,
    int rows, const float* __restrict__ w, const void* ids, int ids_bytes, float* __restrict__ out, int topk, int h) {
  __shared__ uint2 ys[kMaxFusedTopk][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int blocks = h / 128, t = blockIdx.x / blocks, c0 = (blockIdx.x % blocks) * 128;
  for (int j = warp; j < topk; j += warps) {
    const long long p = (long long)t * topk + j;
    if (routed_id(ids, ids_bytes, p) < 0) continue;
    const long long q = pair_rows ? pair_rows[p] : p;
    const GroupSource& src = dn[q / rows];
    half y[4];
    had_out_values(partial + src.partial_base * rows + (q % rows) * h + c0, (size_t)rows * h, src.splits,
                   src.svh + c0, lane, y);
    ys[j][lane] = *reinterpret_cast<const uint2*>(y);
  }
  __syncthreads();
  if (warp != 0) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < topk; ++j) {
    const long long p = (long long)t * topk + j;
    if (routed_id(ids, ids_bytes, p) < 0) continue;
    const uint2 yw = ys[j][lane];
    const half* y = reinterpret_cast<const half*>(&yw);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += w[p] * __half2float(y[i]);
  }
  *reinterpret_cast<float4*>(out + (size_t)t * h + c0 + lane * 4) = make_float4(acc[0], acc[1], acc[2], acc[3]);
}

// ---- rotated-slab MoE glue (layers/moe_rotated.py) ----------------------------------------------------------
// The experts' W_hat decoded once into a slab and SGLang's grouped Triton GEMM on it leave the rotations to the
// pairs: pair p = t * top-k + j has expert e = ids[p] in slab order (below 0: not this rank's; its rows are zero
// and it adds nothing). Every fp16 rounding of had_in / had_out:
//   rot_in: a[p] = had_in(x[t], gate_suh[e]), a[pairs + p] = had_in(x[t], up_suh[e])   (one GEMM runs both)
//   mid:    h[p] = had_in(fp16(act(had_out(c[p], gate_svh[e])) * had_out(c[pairs + p], up_svh[e])), down_suh[e])
//   tail:   out[t] (fp32) = sum over j in top-k order of w[p] * had_out(y[p], down_svh[e])
// At 4,096 rows of a 128-expert top-8 layer these are ~2 million 128-blocks: the warp form's 20 shuffles per block
// (4 elements per lane) made them shuffle-bound, so here 8 lanes hold a block, 16 consecutive elements each:
// strides 1-8 in registers, 16-64 by shuffles within the 8 lanes (12 per block; the same stages in the same
// order, so bit-identical). A warp rotates 4 blocks; every lane joins every shuffle: an octet past the launch's
// blocks rotates zeros and stores nothing, an unrouted pair's octet rotates zeros into its zero rows (rot_in, mid)
// or adds nothing (tail).
constexpr int kSlabPerWarp = 4;  // 128-blocks per warp (8 lanes each)

struct SlabLane {
  long long item;  // this octet's block, counted over the launch
  int t;           // lane within the octet: elements 16t .. 16t + 15 of the block
};
__device__ __forceinline__ SlabLane slab_lane() {
  const int lane = threadIdx.x & 31;
  const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  return {warp * kSlabPerWarp + (lane >> 3), lane & 7};
}
__device__ __forceinline__ void slab_butterfly(float (&v)[16]) {
  butterfly_local<16, 1>(v);  // strides 1, 2, 4, 8
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int s = 1; s < 8; s <<= 1) {  // strides 16, 32, 64: the lanes of the octet
    const bool upper = lane & s;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float p = __shfl_xor_sync(0xffffffffu, v[i], s);
      v[i] = upper ? p - v[i] : v[i] + p;
    }
  }
}
// fp16(r_scale * H(fp16(x * suh))) of an octet's block: x and suh as loaded (16 values each)
__device__ __forceinline__ void slab_had_in(const half (&x)[16], const half (&sv)[16], half (&o)[16]) {
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __half2float(__float2half_rn(__half2float(x[i]) * __half2float(sv[i])));
  slab_butterfly(v);
#pragma unroll
  for (int i = 0; i < 16; ++i) o[i] = __float2half_rn(v[i] * kRScale);
}
// fp16(fp16(r_scale * H(acc)) * svh) of an octet's block of one fp16 split: had_out_values with splits = 1
__device__ __forceinline__ void slab_had_out(const half (&acc)[16], const half (&sv)[16], half (&o)[16]) {
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __half2float(acc[i]);
  slab_butterfly(v);
#pragma unroll
  for (int i = 0; i < 16; ++i)
    o[i] = __float2half_rn(__half2float(__float2half_rn(v[i] * kRScale)) * __half2float(sv[i]));
}
__device__ __forceinline__ void zero16(half (&h)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) h[i] = __float2half_rn(0.f);
}

template <typename T>
__global__ void __launch_bounds__(256) slab_rot_in_kernel(const T* __restrict__ x, const void* ids, int ids_bytes,
                                                          int pairs, int topk, const half* __restrict__ gate_suh,
                                                          const half* __restrict__ up_suh, half* __restrict__ a,
                                                          int k) {
  const SlabLane l = slab_lane();
  const int blocks = k / 128;
  const long long row = l.item / blocks;  // of a: [2 * pairs, k]
  const int c0 = (int)(l.item % blocks) * 128 + 16 * l.t;
  const bool up = row >= pairs;
  const long long p = up ? row - pairs : row;
  const long long e = row < 2LL * pairs ? routed_id(ids, ids_bytes, p) : -1;
  half xv[16], sv[16], o[16];
  if (e >= 0) {
    load16_fp16(x + (p / topk) * k + c0, xv);
    load16_fp16((up ? up_suh : gate_suh) + e * k + c0, sv);
  } else {
    zero16(xv);
    zero16(sv);
  }
  slab_had_in(xv, sv, o);
  if (row < 2LL * pairs) store16(a + row * k + c0, o);  // an unrouted pair's rows: zeros
}

__global__ void __launch_bounds__(256) slab_mid_kernel(const half* __restrict__ c, const void* ids, int ids_bytes,
                                                       int pairs, const half* __restrict__ gate_svh,
                                                       const half* __restrict__ up_svh,
                                                       const half* __restrict__ down_suh, half* __restrict__ h, int n,
                                                       int gelu) {
  const SlabLane l = slab_lane();
  const int blocks = n / 128;
  const long long p = l.item / blocks;
  const int c0 = (int)(l.item % blocks) * 128 + 16 * l.t;
  const long long e = p < pairs ? routed_id(ids, ids_bytes, p) : -1;
  half gc[16], uc[16], gsv[16], usv[16], dsu[16];
  if (e >= 0) {
    load16_fp16(c + p * n + c0, gc);
    load16_fp16(c + (pairs + p) * n + c0, uc);
    load16_fp16(gate_svh + e * n + c0, gsv);
    load16_fp16(up_svh + e * n + c0, usv);
    load16_fp16(down_suh + e * n + c0, dsu);
  } else {
    zero16(gc); zero16(uc); zero16(gsv); zero16(usv); zero16(dsu);
  }
  half g[16], u[16], act[16], o[16];
  slab_had_out(gc, gsv, g);
  slab_had_out(uc, usv, u);
#pragma unroll
  for (int i = 0; i < 16; ++i) act[i] = __float2half_rn(moe_act(__half2float(g[i]), gelu) * __half2float(u[i]));
  slab_had_in(act, dsu, o);
  if (p < pairs) store16(h + p * n + c0, o);  // an unrouted pair's row: zeros
}

__global__ void __launch_bounds__(256) slab_tail_kernel(const half* __restrict__ y, const void* ids, int ids_bytes,
                                                        const float* __restrict__ w,
                                                        const half* __restrict__ down_svh, float* __restrict__ out,
                                                        int tokens, int topk, int hidden) {
  const SlabLane l = slab_lane();
  const int blocks = hidden / 128;
  const long long t = l.item / blocks;
  const int c0 = (int)(l.item % blocks) * 128 + 16 * l.t;
  const bool valid = t < tokens;
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
  for (int j = 0; j < topk; ++j) {  // top-k is uniform over the warp: every lane joins every rotation
    const long long p = t * topk + j;
    const long long e = valid ? routed_id(ids, ids_bytes, p) : -1;
    half yv[16], sv[16], v[16];
    float wj = 0.f;
    if (e >= 0) {
      load16_fp16(y + p * hidden + c0, yv);
      load16_fp16(down_svh + e * hidden + c0, sv);
      wj = w[p];
    } else {
      zero16(yv);
      zero16(sv);
    }
    slab_had_out(yv, sv, v);
    if (e >= 0)
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i] += wj * __half2float(v[i]);
  }
  if (!valid) return;
  float4* o = reinterpret_cast<float4*>(out + t * hidden + c0);
#pragma unroll
  for (int q = 0; q < 4; ++q) o[q] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
}

// ---- MoE decode in two launches (one source per (token, expert) pair, one row each) -----------------------
// The fused forward above is six launches at m = 1 (table, input rotation, gate/up GEMM, moe_mid, down GEMM,
// moe_tail) and its glue cost ~11 us of kernel time plus the gaps between them (benchmarks/results/l2-ab-h200.json).
// Here the gate/up launch finds each pair's expert from the routing itself, rotates its block's K slice of x into
// shared memory (128-element blocks: a slice of whole blocks is local), runs the GEMM, and the last block to finish
// a (pair, 128 columns) does moe_mid's work for it; the down launch (programmatic dependent: scheduled while the
// first drains, waiting for it only before reading its output) runs the GEMM and the last block per (token,
// 128 columns) does moe_tail's work, writing fp32, fp16 or bf16. Every rounding and summation order of the fused
// forward is kept: with the same splits the result is bit-identical. Per-launch counters (zero between calls, each
// reset by the block that completes it) find the last block.
struct MoeDecodeArgs {  // by value: a captured launch keeps its own copy
  const void* x;                                   // fp16 or bf16 [tokens, hidden]
  const GroupSource* gate, *up, *down;             // bank rows, one per local expert
  const void* ids;                                 // [tokens * topk] int32/int64; below 0: not this rank's
  const float* w;                                  // [tokens * topk]
  float* partial_gu;                               // [pairs, 2, gu_splits, inter]
  half* xh_dn;                                     // [pairs, inter]: act(gate) * up, rotated for down
  float* partial_dn;                               // [pairs, dn_splits, hidden]
  int* counters;                                   // [pairs * inter / 128 + tokens * hidden / 128], zero
  void* out;                                       // [tokens, hidden] fp32 / fp16 / bf16 (out_kind 0 / 1 / 2)
  int ids_bytes, pairs, topk, hidden, inter, gu_splits, dn_splits, gelu, out_kind;
};


// Rows [0, xs_rows(m, MT)) of the x slice [kt0, kt1) (whole 128-blocks) = had_in(x * suh), laid out as stage_x lays
// them out; rows past m zero (MT > 2) or absent (the ldmatrix addresses of MT <= 2 re-read row 0, as stage_x's do).
// One warp per (row, 128-block) task, kStageBatch tasks' loads in flight before the first is rotated: one at a time,
// a warp with 16-64 tasks (8 rows, 4096-wide K slices) waited out as many L2 latencies in a row. Returns the lane's
// ldmatrix address, as stage_x does.
constexpr int kStageBatch = 8;
template <int MT, typename T>
__device__ __forceinline__ uint32_t stage_x_rotated_rows(const T* __restrict__ x, int m, int K,
                                                         const half* __restrict__ suh, int kt0, int kt1,
                                                         uint4* __restrict__ xs) {
  const int rows = xs_rows(m, MT), blocks = (kt1 - kt0) / 8, stride16 = (kt1 - kt0) * 2 + 1, tasks = rows * blocks;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int i0 = warp; i0 < tasks; i0 += warps * kStageBatch) {
    half v[kStageBatch][4];
    uint2 sv[kStageBatch];
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = i0 + u * warps, r = i / blocks, b = kt0 / 8 + i % blocks;
      if (i < tasks && r < m) {
        load4_fp16(x + (size_t)r * K + b * 128 + lane * 4, v[u]);
        sv[u] = *reinterpret_cast<const uint2*>(suh + b * 128 + lane * 4);
      }
    }
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int i = i0 + u * warps, r = i / blocks, b = kt0 / 8 + i % blocks;
      if (i >= tasks) break;
      half* dst = reinterpret_cast<half*>(xs + r * stride16) + (b * 8 - kt0) * 16;
      if (r < m) had_in_scaled(v[u], sv[u], dst, lane);
      else *reinterpret_cast<uint2*>(dst + lane * 4) = make_uint2(0u, 0u);
    }
  }
  __syncthreads();
  const int r = (lane & 7) + (MT >= 2 ? (lane >> 4) * 8 : 0);
  const int row = MT > 2 || r < m ? r : 0;
  return (uint32_t)__cvta_generic_to_shared(xs + row * stride16 + ((lane >> 3) & 1));
}

// One block's arrival at a counter that `total` blocks reach; true (in every thread) for the last one, which has
// reset the counter and may read what the others wrote (through L2: __ldcg).
__device__ __forceinline__ bool last_arrival(int* counter, int total, int* flag) {
  __syncthreads();  // every warp's partials are written
  if (threadIdx.x == 0) {
    __threadfence();
    const int done = atomicAdd(counter, 1) == total - 1;
    if (done) *counter = 0;
    *flag = done;
  }
  __syncthreads();
  const bool done = *flag;
  if (done) __threadfence();
  return done;
}

// The same through the x ring (any m, 64-row blocks). Every source's items are a multiple of KW (n_tiles % KW == 0),
// so a block's warps share one source and one K split, as in gemm_group_xs_kernel. With `counters` (one per 64-row
// block and 128 output columns, zero, left zero) the output rotation runs in the same launch: the last block to
// finish a (64 rows, 128 columns) sums its splits' partials and rotates them into `out` [m, total_cols] (fp16, or
// bf16 rounded from it), as had_out_group_kernel would, bit for bit; without, only the partials are written.
template <int K2, int CB, int MT, int KW, int CG>
__global__ void __launch_bounds__(KW * 32) gemm_group_ring_kernel(const half* __restrict__ xh_all,
                                                                 const GroupSource* __restrict__ srcs, int num,
                                                                 float* __restrict__ partial, int m, int k_tiles,
                                                                 int total_items, int* __restrict__ counters,
                                                                 void* __restrict__ out, int out_bf16,
                                                                 int total_cols) {
  extern __shared__ uint4 ring[];
  __shared__ int flag;
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * KW + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  float* part = partial + src.partial_base * m;
  ring_warp<K2, CB, MT, KW, CG>(xh_all + (size_t)s * m * k_tiles * 16, src.tiles, part, m, k_tiles, src.n_tiles,
                                src.splits, local, ring);
  if (counters == nullptr) return;
  const int N = src.n_tiles * 16, j = (local % src.n_tiles) / 8, c0 = j * 128, warp = threadIdx.x >> 5;
  const int row0 = blockIdx.y * kRingMaxRows, rows = min(m - row0, kRingMaxRows);
  int* counter = counters + (size_t)blockIdx.y * (total_cols / 128) + src.col_begin / 128 + j;
  if (!last_arrival(counter, (8 / KW) * src.splits, &flag)) return;
  for (int r = row0 + warp; r < row0 + rows; r += KW) {
    half v[4];
    had_out_values<float, true>(part + (size_t)r * N + c0, (size_t)m * N, src.splits, src.svh + c0, threadIdx.x & 31,
                                v);
    const size_t at = (size_t)r * total_cols + src.col_begin + c0 + (threadIdx.x & 31) * 4;
    if (out_bf16) store4(reinterpret_cast<__nv_bfloat16*>(out) + at, v);
    else store4(reinterpret_cast<half*>(out) + at, v);
  }
}

// A group through the wgmma ring (every source's items a multiple of 8, as for the ring); partials only.
template <int K2, int CB, int NR, int CG>
__global__ void __launch_bounds__(256) gemm_group_wg_kernel(const half* __restrict__ xh_all,
                                                            const GroupSource* __restrict__ srcs, int num,
                                                            float* __restrict__ partial, int m, int k_tiles,
                                                            int total_items) {
  extern __shared__ uint4 ring[];
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * 8 + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  wg_warp<K2, CB, NR, CG>(xh_all + (size_t)s * m * k_tiles * 16, src.tiles, partial + src.partial_base * m, m,
                          k_tiles, src.n_tiles, src.splits, local, ring);
}

// A group through the wgmma ring with the `splits` K splits of each 128-column block in one thread-block cluster
// (every source has `splits` splits; the cluster's size): each block stages its accumulators in shared memory, and
// after a cluster barrier block `split` sums rows split, split + splits, ... over the cluster's blocks through
// distributed shared memory, in split order, then rotates and scales them as had_out does and writes y. No partials
// reach global memory and no output rotation launch follows. Blocks of source s are [item_begin / 8, + n_tiles *
// splits / 8): block lb of them is column block lb / splits, split lb % splits (its rank: item_begin / 8 is a multiple
// of splits, so a cluster never straddles two sources, and an empty source's clusters return whole).
template <int K2, int CB, int NR, int CG>
__global__ void __launch_bounds__(256) gemm_group_wg_cluster_kernel(const half* __restrict__ xh_all,
                                                                    const GroupSource* __restrict__ srcs, int num,
                                                                    void* __restrict__ out, int out_bf16, int m,
                                                                    int k_tiles, int total_cols, int splits) {
#ifdef EXL3_HAS_WGMMA
  extern __shared__ uint4 ring[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int s = group_source_of_item(srcs, num, (long long)blockIdx.x * 8);
  const GroupSource& src = srcs[s];
  const int lb = blockIdx.x - (int)(src.item_begin / 8);
  if (src.n_tiles == 0 || lb >= src.n_tiles * splits / 8) return;
  const int cb = lb / splits, split = lb % splits;
  wg_warp<K2, CB, NR, CG, true>(xh_all + (size_t)s * m * k_tiles * 16, src.tiles, nullptr, m, k_tiles, src.n_tiles,
                                splits, split * src.n_tiles + cb * 8 + warp, ring);
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();  // every split's accumulators are staged
  const int row0 = blockIdx.y * NR, mb = min(m - row0, NR);
  float* staged = reinterpret_cast<float*>(ring);
  for (int r = split + splits * warp; r < mb; r += splits * 8) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < splits; ++j) {  // split order, as had_out_values sums
      const float4 t = *reinterpret_cast<const float4*>(cluster.map_shared_rank(staged, j) + r * 128 + lane * 4);
      v[0] += t.x;
      v[1] += t.y;
      v[2] += t.z;
      v[3] += t.w;
    }
    half op[4];
    had_out_finish(v, src.svh + cb * 128, lane, op);
    const size_t at = (size_t)(row0 + r) * total_cols + src.col_begin + cb * 128 + lane * 4;
    if (out_bf16) store4(reinterpret_cast<__nv_bfloat16*>(out) + at, op);
    else store4(reinterpret_cast<half*>(out) + at, op);
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
#else
  __trap();  // the launcher checks exl3_wgmma_available() first
#endif
}

// Block (pair p, 64 columns jb, role, split): grid pairs * (inter / 64) * 2 * gu_splits, kWarps warps.
template <int K2, int CB, typename T>
__global__ void __launch_bounds__(kWarps * 32) moe_decode_gu_kernel(MoeDecodeArgs a) {
  extern __shared__ uint4 xs[];
  __shared__ uint2 up_vals[32];
  __shared__ int flag;
  pdl_launch_dependents();  // the down launch may be scheduled once every block here has started
  const int S = a.gu_splits, n64 = a.inter / 64;
  int b = blockIdx.x;
  const int split = b % S;
  b /= S;
  const int role = b & 1;
  b >>= 1;
  const int jb = b % n64, p = b / n64;
  const long long e = routed_id(a.ids, a.ids_bytes, p);
  if (e < 0) return;  // the whole block: another rank's expert (weighed 0, never read)
  const GroupSource& src = (role ? a.up : a.gate)[e];
  const int kt = a.hidden / 16, nt = a.inter / 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const T* xrow = reinterpret_cast<const T*>(a.x) + (size_t)(p / a.topk) * a.hidden;
  auto stage = [&](int kt0, int kt1) { return stage_x_rotated_rows<1>(xrow, 1, a.hidden, src.suh, kt0, kt1, xs); };
  gemm_warp<K2, CB, 1, 4, true>(nullptr, src.tiles, a.partial_gu + (size_t)(p * 2 + role) * S * a.inter, 1, kt,
                                     nt, S, split * nt + jb * kWarps + warp, xs, stage);
  const int j = jb >> 1, c0 = j * 128;
  if (!last_arrival(a.counters + (size_t)p * (a.inter / 128) + j, 4 * S, &flag)) return;
  // moe_mid for (p, j): gate's and up's output rotations in warps 0 and 1, then act * up and down's input rotation
  half v[4];
  if (warp < 2) {
    const GroupSource& r = (warp ? a.up : a.gate)[e];
    had_out_values<float, true>(a.partial_gu + ((size_t)(p * 2 + warp) * S) * a.inter + c0, a.inter, S, r.svh + c0,
                                lane, v);
    if (warp == 1) up_vals[lane] = *reinterpret_cast<const uint2*>(v);
  }
  __syncthreads();
  if (warp != 0) return;
  const uint2 uw = up_vals[lane];
  const half* uv = reinterpret_cast<const half*>(&uw);
  half act[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) act[i] = __float2half_rn(moe_act(__half2float(v[i]), a.gelu) * __half2float(uv[i]));
  had_in_values(act, a.down[e].suh + c0, a.xh_dn + (size_t)p * a.inter + c0, lane);
}

// Block (pair p, 64 columns jb of the hidden size, split): grid pairs * (hidden / 64) * dn_splits, kWarps warps.
template <int K2, int CB>
__global__ void __launch_bounds__(kWarps * 32) moe_decode_dn_kernel(MoeDecodeArgs a) {
  extern __shared__ uint4 xs[];
  __shared__ uint2 ys[kMaxFusedTopk][32];
  __shared__ int flag;
  const int S = a.dn_splits, n64 = a.hidden / 64;
  int b = blockIdx.x;
  const int split = b % S;
  b /= S;
  const int jb = b % n64, p = b / n64;
  const long long e = routed_id(a.ids, a.ids_bytes, p);
  const int t = p / a.topk, c0 = (jb >> 1) * 128;
  int valid = 0;
  for (int q = 0; q < a.topk; ++q) valid += routed_id(a.ids, a.ids_bytes, (long long)t * a.topk + q) >= 0;
  if (e < 0) {  // another rank's expert; a token with none of this rank's gets a zero row from its first pair
    if (valid == 0 && p % a.topk == 0 && split == 0 && threadIdx.x < 64) {
      const size_t at = (size_t)t * a.hidden + jb * 64 + threadIdx.x;
      if (a.out_kind == 0) reinterpret_cast<float*>(a.out)[at] = 0.f;
      else if (a.out_kind == 1) reinterpret_cast<half*>(a.out)[at] = __float2half_rn(0.f);
      else reinterpret_cast<__nv_bfloat16*>(a.out)[at] = __float2bfloat16_rn(0.f);
    }
    return;
  }
  const GroupSource& src = a.down[e];
  const int kt = a.inter / 16, nt = a.hidden / 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const half* xrow = a.xh_dn + (size_t)p * a.inter;
  // stage_x's one-row case, but read through L2 (x was written by the launch this one overlaps) and without its
  // per-element row division: this runs on the critical path after the wait
  auto stage = [&](int kt0, int kt1) {  // after the gate/up launch has finished (its first loads are in flight)
    pdl_wait();
    const int row16 = (kt1 - kt0) * 2;
    for (int i = threadIdx.x; i < row16; i += blockDim.x)
      xs[i] = __ldcg(reinterpret_cast<const uint4*>(xrow + kt0 * 16) + i);
    __syncthreads();
    return (uint32_t)__cvta_generic_to_shared(xs + ((lane >> 3) & 1));
  };
  gemm_warp<K2, CB, 1, 4, true>(xrow, src.tiles, a.partial_dn + (size_t)p * S * a.hidden, 1, kt, nt, S,
                                     split * nt + jb * kWarps + warp, xs, stage);
  int* counter = a.counters + (size_t)a.pairs * (a.inter / 128) + (size_t)t * (a.hidden / 128) + (jb >> 1);
  if (!last_arrival(counter, valid * 2 * S, &flag)) return;
  // moe_tail for (t, c0): the top-k rows' output rotations in parallel warps, summed in top-k order by warp 0
  for (int q = warp; q < a.topk; q += kWarps) {
    const long long pq = (long long)t * a.topk + q;
    const long long eq = routed_id(a.ids, a.ids_bytes, pq);
    if (eq < 0) continue;
    half y[4];
    had_out_values<float, true>(a.partial_dn + (size_t)pq * S * a.hidden + c0, a.hidden, S, a.down[eq].svh + c0,
                                lane, y);
    ys[q][lane] = *reinterpret_cast<const uint2*>(y);
  }
  __syncthreads();
  if (warp != 0) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int q = 0; q < a.topk; ++q) {
    const long long pq = (long long)t * a.topk + q;
    if (routed_id(a.ids, a.ids_bytes, pq) < 0) continue;
    const uint2 yw = ys[q][lane];
    const half* y = reinterpret_cast<const half*>(&yw);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += a.w[pq] * __half2float(y[i]);
  }
  const size_t at = (size_t)t * a.hidden + c0 + lane * 4;
  if (a.out_kind == 0) {
    *reinterpret_cast<float4*>(reinterpret_cast<float*>(a.out) + at) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  } else if (a.out_kind == 1) {
    half2* o = reinterpret_cast<half2*>(reinterpret_cast<half*>(a.out) + at);
    o[0] = __floats2half2_rn(acc[0], acc[1]);
    o[1] = __floats2half2_rn(acc[2], acc[3]);
  } else {
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(a.out) + at);
    o[0] = __floats2bfloat162_rn(acc[0], acc[1]);
    o[1] = __floats2bfloat162_rn(acc[2], acc[3]);
  }
}

// ---- a dense linear (or a same-input group) in one launch, for decode-sized m ---------------------------------
constexpr int kOneLaunchMaxRows = 16;  // one or two 8-row groups; from 16 rows the x ring serves
// exl3_group_linear's three launches in one: each block rotates its K slice of x (whole 128-blocks; every split of
// every source cuts K into such blocks) into shared memory as stage_x lays it out, runs gemm_warp on it, and the last
// block to finish a (source, 128 columns) sums that column block's partials and rotates them into the output. Same
// roundings and summation orders as the three launches: with the same splits the output is bit-identical. Counters
// (one per 128 output columns of the group) are zero between calls; each is reset by the block that completes it.

// One warp per work item, as gemm_group_xs_kernel's (every source's items a multiple of 8: a block's KW = 4 or 8 warps
// share one source, one split and half of or a whole 128-column block); x and y [m, total_cols] in the model's dtype A
// (fp16 or bf16). Launched as a programmatic dependent (PDL): the first trellis loads are issued before the wait for
// the kernel that wrote x, and nothing is written before it. With xh_all (fp16 [num, m, K], had_in_group's output:
// the two-launch form, opt-in: slower than three launches as a kernel, decisions.md) a block copies its slice of the
// rotated x instead of rotating it, while the output rotation stays folded in.
template <int K2, int CB, int MT, int KW, typename A>
__global__ void __launch_bounds__(KW * 32) linear_decode_kernel(const A* __restrict__ x,
                                                                const half* __restrict__ xh_all,
                                                                const GroupSource* __restrict__ srcs, int num,
                                                                float* __restrict__ partial,
                                                                int* __restrict__ counters, A* __restrict__ out, int m,
                                                                int k_tiles, int total_items, int total_cols) {
  extern __shared__ uint4 xs[];
  __shared__ int flag;
  int s, local;
  if (!group_work(srcs, num, blockIdx.x * KW + (threadIdx.x >> 5), total_items, s, local)) return;
  const GroupSource& src = srcs[s];
  const int K = k_tiles * 16, N = src.n_tiles * 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const A* xs_rows0 = x + (size_t)src.x_row * K;
  auto stage = [&](int kt0, int kt1) {
    pdl_wait();
    if (xh_all != nullptr) return stage_x<MT>(xh_all + (size_t)s * m * K, m, K, kt0, kt1, xs);
    return stage_x_rotated_rows<MT>(xs_rows0, m, K, src.suh, kt0, kt1, xs);
  };
  float* part = partial + src.partial_base * m;
  gemm_warp<K2, CB, MT, kDepth, true>(nullptr, src.tiles, part, m, k_tiles, src.n_tiles, src.splits, local, xs,
                                      stage);
  const int j = (local % src.n_tiles) / 8, c0 = j * 128;
  if (!last_arrival(counters + src.col_begin / 128 + j, (8 / KW) * src.splits, &flag)) return;
  for (int r = warp; r < m; r += KW) {
    half v[4];
    had_out_values<float, true>(part + (size_t)r * N + c0, (size_t)m * N, src.splits, src.svh + c0, lane, v);
    store4(out + (size_t)r * total_cols + src.col_begin + c0 + lane * 4, v);
  }
}

// ---- dispatch ----------------------------------------------------------------------------------

// Calls launch(std::integral_constant<int, MT>) for the 8-row groups m needs (MT = 1, 2, 4 or 8).
template <typename Launch>
int with_row_groups(int m, Launch&& launch) {
  if (m <= 8) launch(std::integral_constant<int, 1>{});
  else if (m <= 16) launch(std::integral_constant<int, 2>{});
  else if (m <= 32) launch(std::integral_constant<int, 4>{});
  else if (m <= 64) launch(std::integral_constant<int, 8>{});
  else return -2;
  return (int)cudaGetLastError();
}

template <int K2, int CB>
int launch_variant_gemm(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt,
                        int splits, cudaStream_t stream) {
  const dim3 grid((nt * splits + kWarps - 1) / kWarps), block(kWarps * 32);
  return with_row_groups(m, [&](auto mt) {
    gemm_kernel<K2, CB, decltype(mt)::value, kDepth><<<grid, block, 0, stream>>>(xh, trellis, partial, m, kt, nt,
                                                                                 splits);
  });
}

// Shared memory of gemm_xs_kernel: min(m, 16) rows of the longest K slice, plus the 16-byte skew per row.
inline int xs_smem_bytes(int m, int kt, int splits) {
  const int slice = (kt + splits - 1) / splits;
  const int mt = m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
  return xs_rows(m, mt) * (slice * 32 + 16);
}
constexpr int kMaxXsSmem = 96 << 10;

// More than the default 48 KB of dynamic shared memory needs the kernel's opt-in, set on every such launch
// (cudaFuncSetAttribute is not a stream operation, so CUDA-graph capture allows it; FlashAttention does the same).
template <typename Kernel>
void allow_smem(Kernel kernel, int smem) {
  if (smem > (48 << 10)) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxXsSmem);
}

// Launches kernel_of(row groups) with `smem` bytes of dynamic shared memory.
template <typename KernelOf, typename... Args>
int launch_with_smem(int m, int smem, dim3 grid, cudaStream_t stream, KernelOf kernel_of, Args... args) {
  if (smem > kMaxXsSmem) return -3;
  return with_row_groups(m, [&](auto mt) {
    auto kernel = kernel_of(mt);
    allow_smem(kernel, smem);
    launch_plain(kernel, grid, kWarps * 32, smem, stream, args...);
  });
}

template <int K2, int CB>
int launch_variant_gemm_xs(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt,
                           int splits, cudaStream_t stream) {
  if (m > 64 || nt % kWarps) return -3;
  auto kernel_of = [](auto mt) { return gemm_xs_kernel<K2, CB, decltype(mt)::value, kDepth>; };
  return launch_with_smem(m, xs_smem_bytes(m, kt, splits), dim3(nt * splits / kWarps), stream, kernel_of, xh, trellis,
                          partial, m, kt, nt, splits);
}

// Launches kernel_of(row groups, warps per block, chunk groups) over grid_x blocks per 64-row block of x, with the
// ring's shared memory (at 64 rows: 27 KB with one group per chunk, 35 KB with two). `mode` = warps * 10 + chunk
// groups: 81 or 82 (4-warp blocks measured no faster anywhere the dispatch uses the ring: ring-ab-h200).
template <typename KernelOf, typename... Args>
int launch_ring(int m, int mode, int grid_x, cudaStream_t stream, KernelOf kernel_of, Args... args) {
  const dim3 grid(grid_x, (m + kRingMaxRows - 1) / kRingMaxRows);
  return with_row_groups(m < kRingMaxRows ? m : kRingMaxRows, [&](auto mt) {
    constexpr int MT = decltype(mt)::value;
    using W8 = std::integral_constant<int, 8>;
    if (mode == 81)
      kernel_of(mt, W8{}, std::integral_constant<int, 1>{})<<<grid, 8 * 32, ring_smem(MT, 1), stream>>>(args...);
    else
      kernel_of(mt, W8{}, std::integral_constant<int, 2>{})<<<grid, 8 * 32, ring_smem(MT, 2), stream>>>(args...);
  });
}

inline bool ring_mode_ok(int mode) { return mode == 81 || mode == 82; }

template <int K2, int CB>
int launch_variant_gemm_ring(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt,
                             int splits, int mode, cudaStream_t stream) {
  const int warps = mode / 10;
  if (nt % warps) return -3;
  auto kernel_of = [](auto mt, auto kw, auto cg) {
    return gemm_ring_kernel<K2, CB, decltype(mt)::value, decltype(kw)::value, decltype(cg)::value>;
  };
  return launch_ring(m, mode, nt * splits / warps, stream, kernel_of, xh, trellis, partial, m, kt, nt, splits);
}

template <int K2, int CB>
int launch_variant_gemm_group_ring(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                                   int total_items, int mode, int* counters, void* out, int out_bf16, int total_cols,
                                   cudaStream_t stream) {
  const int warps = mode / 10;
  if (total_items % warps) return -3;
  auto kernel_of = [](auto mt, auto kw, auto cg) {
    return gemm_group_ring_kernel<K2, CB, decltype(mt)::value, decltype(kw)::value, decltype(cg)::value>;
  };
  return launch_ring(m, mode, total_items / warps, stream, kernel_of, xh_all, srcs, num, partial, m, kt, total_items,
                     counters, out, out_bf16, total_cols);
}

// wgmma ring kernels: wg_rows(m) rows per block (blockIdx.y); mode 91 / 92 = one / two trellis groups per chunk (256
// rows: always one, which is 128 KB of ring). Refused (-1) unless exl3_wgmma_available() found them in this build.
static int g_wgmma = -1;  // exl3_wgmma_available()'s answer; -1 before it ran
constexpr int kMaxWgSmem = 129 << 10;
template <typename KernelOf, typename... Args>
int launch_wg(int m, int mode, int grid_x, cudaStream_t stream, KernelOf kernel_of, Args... args) {
  if (g_wgmma != 1) return -1;
  const int nr = wg_rows(m);
  const dim3 grid(grid_x, (m + nr - 1) / nr);
  auto go = [&](auto rows, auto cg) -> int {
    constexpr int NR = decltype(rows)::value, CG = decltype(cg)::value, smem = wg_smem(NR, CG);
    static_assert(smem <= kMaxWgSmem, "wgmma ring too large");
    auto kernel = kernel_of(rows, cg);
    if (smem > (48 << 10)) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<grid, 256, smem, stream>>>(args...);
    return (int)cudaGetLastError();
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  auto with_cg = [&](auto rows) -> int { return mode == 92 ? go(rows, Two{}) : go(rows, One{}); };
  switch (nr) {
    case 16: return with_cg(std::integral_constant<int, 16>{});
    case 32: return with_cg(std::integral_constant<int, 32>{});
    case 64: return with_cg(std::integral_constant<int, 64>{});
    case 128: return with_cg(std::integral_constant<int, 128>{});
    default: return go(std::integral_constant<int, 256>{}, One{});
  }
}

template <int K2, int CB>
int launch_variant_gemm_wg(const half* xh, const uint32_t* trellis, float* partial, int m, int kt, int nt, int splits,
                           int mode, cudaStream_t stream) {
  if (nt % 8) return -3;
  auto kernel_of = [](auto rows, auto cg) {
    return gemm_wg_kernel<K2, CB, decltype(rows)::value, decltype(cg)::value>;
  };
  return launch_wg(m, mode, nt * splits / 8, stream, kernel_of, xh, trellis, partial, m, kt, nt, splits);
}

template <int K2, int CB>
int launch_variant_gemm_group_wg(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                                 int total_items, int mode, cudaStream_t stream) {
  if (total_items % 8) return -3;
  auto kernel_of = [](auto rows, auto cg) {
    return gemm_group_wg_kernel<K2, CB, decltype(rows)::value, decltype(cg)::value>;
  };
  return launch_wg(m, mode, total_items / 8, stream, kernel_of, xh_all, srcs, num, partial, m, kt, total_items);
}

constexpr int kMaxClusterSplits = 8;  // the portable cluster size
template <int K2, int CB>
int launch_variant_gemm_group_wg_cluster(const half* xh_all, const GroupSource* srcs, int num, void* out, int out_bf16,
                                         int m, int kt, int total_items, int total_cols, int splits,
                                         cudaStream_t stream) {
  if (g_wgmma != 1) return -1;
  constexpr int NR = 64, CG = 1, smem = wg_smem(NR, CG);
  auto kernel = gemm_group_wg_cluster_kernel<K2, CB, NR, CG>;
  if (smem > (48 << 10)) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = splits;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(total_items / 8, (m + NR - 1) / NR);
  config.blockDim = dim3(256);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&config, kernel, xh_all, srcs, num, out, out_bf16, m, kt, total_cols, splits);
}

// x slices in shared memory for a group (xs_slice: the longest K slice of its sources, in tiles; 0: global loads)
template <int K2, int CB>
int launch_variant_gemm_group_xs(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                                 int total_items, int xs_slice, cudaStream_t stream) {
  if (m > 64 || total_items % kWarps) return -3;
  auto kernel_of = [](auto mt) { return gemm_group_xs_kernel<K2, CB, decltype(mt)::value, kDepth>; };
  return launch_with_smem(m, xs_smem_bytes(m, xs_slice, 1), dim3(total_items / kWarps), stream, kernel_of, xh_all,
                          srcs, num, partial, m, kt, total_items);
}

template <int K2, int CB>
int launch_variant_gemm_group(const half* xh_all, const GroupSource* srcs, int num, float* partial, int m, int kt,
                              int total_items, cudaStream_t stream) {
  const dim3 grid((total_items + kWarps - 1) / kWarps), block(kWarps * 32);
  return with_row_groups(m, [&](auto mt) {
    gemm_group_kernel<K2, CB, decltype(mt)::value, kDepth><<<grid, block, 0, stream>>>(xh_all, srcs, num, partial, m,
                                                                                       kt, total_items);
  });
}

template <int K2, int CB>
int launch_variant_linear_decode(const void* x, int bf16, half* xh_all, const GroupSource* srcs, int num,
                                 float* partial, int* counters, void* out, int m, int kt, int total_items,
                                 int total_cols, int xs_slice, int warps, int pdl, cudaStream_t stream) {
  if (m > kOneLaunchMaxRows || (warps != 4 && warps != 8) || total_items % warps) return -3;
  const int smem = xs_smem_bytes(m, xs_slice, 1);
  if (smem > kMaxXsSmem) return -3;
  if (xh_all != nullptr) {  // the two-launch form: every check passed, so the rotation never runs alone
    if (bf16) launch_had_in_group((const __nv_bfloat16*)x, srcs, num, xh_all, m, kt * 16, stream);
    else launch_had_in_group((const half*)x, srcs, num, xh_all, m, kt * 16, stream);
  }
  auto launch = [&](auto* op, auto mt, auto kw) {
    using A = std::remove_pointer_t<decltype(op)>;
    auto kernel = linear_decode_kernel<K2, CB, decltype(mt)::value, decltype(kw)::value, A>;
    allow_smem(kernel, smem);
    return launch_ex(kernel, dim3(total_items / warps), warps, smem, pdl != 0, stream, (const A*)x, xh_all, srcs,
                     num, partial, counters, op, m, kt, total_items, total_cols);
  };
  auto with_warps = [&](auto* op, auto mt) {
    return warps == 8 ? launch(op, mt, std::integral_constant<int, 8>{})
                      : launch(op, mt, std::integral_constant<int, 4>{});
  };
  auto with_rows = [&](auto* op) {  // one or two 8-row groups (m <= 16)
    return m <= 8 ? with_warps(op, std::integral_constant<int, 1>{}) : with_warps(op, std::integral_constant<int, 2>{});
  };
  return bf16 ? with_rows((__nv_bfloat16*)out) : with_rows((half*)out);
}

template <int K2, int CB>
int launch_variant_reconstruct_rot_out(const uint32_t* trellis, const half* svh, half* out, int kt, int tn0,
                                       int tn_count, int ld, cudaStream_t stream) {
  const dim3 grid(tn_count / 8, (kt + kRotRows / 16 - 1) / (kRotRows / 16));
  reconstruct_rot_out_kernel<K2, CB><<<grid, kRotThreads, 0, stream>>>(trellis, svh, out, kt, tn0, ld);
  return (int)cudaGetLastError();
}

template <int K2, int CB>
int launch_variant_reconstruct(const uint32_t* trellis, half* out, int kt, int nt, int tn0, int tn_count, int ld,
                               cudaStream_t stream) {
  const int tiles = kt * tn_count;
  reconstruct_kernel<K2, CB><<<(tiles + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(trellis, out, kt, nt, tn0,
                                                                                        tn_count, ld);
  return (int)cudaGetLastError();
}

// The decode MoE's launches: x slices of `slice` tiles (one row + the 16-byte skew) in dynamic shared memory;
// the down launch as a programmatic dependent of the gate/up one when `pdl`.
template <typename Kernel>
int launch_decode(Kernel kernel, int blocks, int slice, bool pdl, cudaStream_t stream, const MoeDecodeArgs& a) {
  const int smem = xs_smem_bytes(1, slice, 1);
  if (smem > kMaxXsSmem) return -3;
  allow_smem(kernel, smem);
  return launch_ex(kernel, dim3(blocks), kWarps, smem, pdl, stream, a);
}

template <int K2, int CB>
int launch_variant_decode_gu(const MoeDecodeArgs& a, int x_bf16, cudaStream_t stream) {
  const int blocks = a.pairs * (a.inter / 64) * 2 * a.gu_splits, slice = a.hidden / 16 / a.gu_splits;
  if (x_bf16) return launch_decode(moe_decode_gu_kernel<K2, CB, __nv_bfloat16>, blocks, slice, false, stream, a);
  return launch_decode(moe_decode_gu_kernel<K2, CB, half>, blocks, slice, false, stream, a);
}

template <int K2, int CB>
int launch_variant_decode_dn(const MoeDecodeArgs& a, int pdl, cudaStream_t stream) {
  const int blocks = a.pairs * (a.hidden / 64) * a.dn_splits, slice = a.inter / 16 / a.dn_splits;
  return launch_decode(moe_decode_dn_kernel<K2, CB>, blocks, slice, pdl != 0, stream, a);
}

// Calls F<K2, CB>::run(args...) for the supported (K2, codebook) pairs: whole bits 1..8 in every
// codebook, half bits (K2 odd: 1.5, 2.5, 3.5) in MUL1. Returns -1 for anything else.
#define EXL3_CASE1(K2, CB, CALL, ARGS) \
  case (K2) * 4 + (CB): return CALL<K2, CB> ARGS;
#define EXL3_CASE3(K2, CALL, ARGS) \
  EXL3_CASE1(K2, 0, CALL, ARGS) EXL3_CASE1(K2, 1, CALL, ARGS) EXL3_CASE1(K2, 2, CALL, ARGS)
#ifdef EXL3_DEV_4BIT_MCG  // kernel development: only 4-bit MCG, built in a fraction of the time (never shipped)
#define EXL3_DISPATCH(K2V, CBV, CALL, ARGS) \
  switch ((K2V) * 4 + (CBV)) {              \
    EXL3_CASE1(8, 1, CALL, ARGS)            \
    default: return -1;                     \
  }
#else
#define EXL3_DISPATCH(K2V, CBV, CALL, ARGS)                                                              \
  switch ((K2V) * 4 + (CBV)) {                                                                           \
    EXL3_CASE3(2, CALL, ARGS) EXL3_CASE3(4, CALL, ARGS) EXL3_CASE3(6, CALL, ARGS)                        \
    EXL3_CASE3(8, CALL, ARGS) EXL3_CASE3(10, CALL, ARGS) EXL3_CASE3(12, CALL, ARGS)                      \
    EXL3_CASE3(14, CALL, ARGS) EXL3_CASE3(16, CALL, ARGS)                                                \
    EXL3_CASE1(3, 2, CALL, ARGS) EXL3_CASE1(5, 2, CALL, ARGS) EXL3_CASE1(7, 2, CALL, ARGS)               \
    default: return -1;                                                                                  \
  }
#endif

}  // namespace

extern "C" {

// Error codes: 0 ok, -1 unsupported (bits, codebook), -2 unsupported m, -3 bad shape, else a cudaError_t.

int exl3_reconstruct(const void* trellis, void* out, int k_tiles, int n_tiles, int tn0, int tn_count, int ld,
                     int k2, int codebook, void* stream) {
  if (k_tiles <= 0 || tn_count <= 0 || tn0 < 0 || tn0 + tn_count > n_tiles || ld < tn_count * 16 || ld % 8)
    return -3;
  auto s = (cudaStream_t)stream;
  auto t = (const uint32_t*)trellis;
  auto o = (half*)out;
  EXL3_DISPATCH(k2, codebook, launch_variant_reconstruct, (t, o, k_tiles, n_tiles, tn0, tn_count, ld, s))
}

// W' = W_hat[:, column tiles tn0 ..] H r diag(svh[those columns]) as fp16 [K, ld] (tn_count a multiple of 8: whole
// 128-column blocks); svh points at the first of those columns.
int exl3_reconstruct_rot_out(const void* trellis, const void* svh, void* out, int k_tiles, int n_tiles, int tn0,
                             int tn_count, int ld, int k2, int codebook, void* stream) {
  if (k_tiles <= 0 || tn_count <= 0 || tn_count % 8 || tn0 < 0 || tn0 + tn_count > n_tiles || ld < tn_count * 16 ||
      ld % 8)
    return -3;
  auto s = (cudaStream_t)stream;
  auto t = (const uint32_t*)trellis;
  auto v = (const half*)svh;
  auto o = (half*)out;
  EXL3_DISPATCH(k2, codebook, launch_variant_reconstruct_rot_out, (t, v, o, k_tiles, tn0, tn_count, ld, s))
}

static int gemm_partial(bool xs, const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                        int splits, int k2, int codebook, void* stream) {
  if (m <= 0 || k_tiles <= 0 || n_tiles <= 0 || splits <= 0 || splits > k_tiles) return -3;
  auto s = (cudaStream_t)stream;
  auto x = (const half*)xh;
  auto t = (const uint32_t*)trellis;
  auto p = (float*)partial;
  if (xs) EXL3_DISPATCH(k2, codebook, launch_variant_gemm_xs, (x, t, p, m, k_tiles, n_tiles, splits, s))
  EXL3_DISPATCH(k2, codebook, launch_variant_gemm, (x, t, p, m, k_tiles, n_tiles, splits, s))
}

int exl3_gemm_partial(const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                      int splits, int k2, int codebook, void* stream) {
  return gemm_partial(false, xh, trellis, partial, m, k_tiles, n_tiles, splits, k2, codebook, stream);
}

// exl3_gemm_partial with x staged in shared memory per block (m <= 64, n_tiles % 4 == 0, at most 96 KB of x slice
// per block: see xs_smem_bytes); the same partials, bit for bit.
int exl3_gemm_partial_xs(const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                         int splits, int k2, int codebook, void* stream) {
  return gemm_partial(true, xh, trellis, partial, m, k_tiles, n_tiles, splits, k2, codebook, stream);
}

// exl3_gemm_partial with x streamed through a shared-memory ring (any m, 64 rows per block row; mode = warps per
// block * 10 + trellis groups per chunk: 81 or 82; n_tiles % 8 == 0); the same partials, bit for bit, at equal
// splits.
int exl3_gemm_partial_ring(const void* xh, const void* trellis, void* partial, int m, int k_tiles, int n_tiles,
                           int splits, int k2, int codebook, int mode, void* stream) {
  if (m <= 0 || k_tiles <= 0 || n_tiles <= 0 || splits <= 0 || splits > k_tiles ||
      !(ring_mode_ok(mode) || wg_mode_ok(mode)))
    return -3;
  auto s = (cudaStream_t)stream;
  auto x = (const half*)xh;
  auto t = (const uint32_t*)trellis;
  auto p = (float*)partial;
  if (wg_mode_ok(mode))
    EXL3_DISPATCH(k2, codebook, launch_variant_gemm_wg, (x, t, p, m, k_tiles, n_tiles, splits, mode, s))
  EXL3_DISPATCH(k2, codebook, launch_variant_gemm_ring, (x, t, p, m, k_tiles, n_tiles, splits, mode, s))
}

// x fp16, or bf16 (x_bf16: rounded to fp16 as it is read, exactly what casting it beforehand does)
int exl3_had_in(const void* x, int x_bf16, const void* suh, void* out, int rows, int cols, void* stream) {
  if (rows <= 0 || cols <= 0 || cols % 128) return -3;
  const long long items = (long long)rows * (cols / 128);
  auto s = (cudaStream_t)stream;
  auto launch = [&](auto* xp) {
    if (use_octet(items, false))
      launch_plain(had_in_octet_kernel<elem_t<decltype(xp)>>, dim3(octet_grid(items)), 256, 0, s, xp,
                   (const half*)suh, (half*)out, rows, cols);
    else
      launch_plain(had_in_kernel<elem_t<decltype(xp)>>, dim3((unsigned)((items + 7) / 8)), 256, 0, s, xp,
                   (const half*)suh, (half*)out, rows, cols);
  };
  if (x_bf16) launch((const __nv_bfloat16*)x);
  else launch((const half*)x);
  return (int)cudaGetLastError();
}

// out fp16, or bf16 (out_bf16: the fp16 result rounded to bf16, exactly what casting it afterwards does)
int exl3_had_out(const void* acc, int acc_is_fp32, const void* svh, void* out, int out_bf16, int splits, int rows,
                 int cols, void* stream) {
  if (rows <= 0 || cols <= 0 || cols % 128 || splits <= 0) return -3;
  const long long items = (long long)rows * (cols / 128);
  auto s = (cudaStream_t)stream;
  auto launch = [&](auto* o) {
    auto run = [&](auto* a) {
      if (use_octet(items, acc_is_fp32))
        launch_plain(had_out_octet_kernel<elem_t<decltype(a)>, elem_t<decltype(o)>>, dim3(octet_grid(items)), 256, 0,
                     s, a, (const half*)svh, o, splits, rows, cols);
      else
        launch_plain(had_out_kernel<elem_t<decltype(a)>, elem_t<decltype(o)>>, dim3((unsigned)((items + 7) / 8)), 256,
                     0, s, a, (const half*)svh, o, splits, rows, cols);
    };
    if (acc_is_fp32) run((const float*)acc);
    else run((const half*)acc);
  };
  if (out_bf16) launch((__nv_bfloat16*)out);
  else launch((half*)out);
  return (int)cudaGetLastError();
}

// y[m, total_cols] for a same-input group of sources sharing bits and codebook (table: GroupSource[num] in device
// memory); x and y fp16, or bf16 (x_bf16, y_bf16: the same values as casting around an fp16 call). Scratch: xh_all
// fp16 [num, m, K], partial fp32 [sum_s splits_s * N_s * m]. Three launches in all.
// xs_slice > 0 (m <= 64): the GEMM stages x in shared memory, sized for K slices of up to xs_slice tiles (the
// longest slice of any source); ring_mode (exl3_gemm_partial_ring's; any m; every source's N a multiple of 16 *
// its warps): x through the ring instead. The partials are the same bit for bit. counters (ring only; int32, one per
// 64-row block and 128 output columns, at least counters_len; zero, and left zero): the ring launch rotates the
// output itself, so two launches in all; nullptr: the separate output rotation.
int exl3_group_linear(const void* x, int x_bf16, const void* table, int num, void* xh_all, void* partial, void* out,
                      int y_bf16, int m, int k_tiles, int total_items, int total_cols, int k2, int codebook,
                      int xs_slice, int ring_mode, void* counters, long long counters_len, void* stream) {
  if (m <= 0 || num <= 0 || k_tiles <= 0 || total_items <= 0 || total_cols <= 0 || total_cols % 128) return -3;
  const bool ring = ring_mode_ok(ring_mode), wg = wg_mode_ok(ring_mode);
  // the ring's output rotation in its own launch needs a counter per 64-row block and 128 columns
  if (counters != nullptr && (!ring || counters_len < (long long)((m + kRingMaxRows - 1) / kRingMaxRows) *
                                                          (total_cols / 128)))
    return -3;
  auto s = (cudaStream_t)stream;
  auto srcs = (const GroupSource*)table;
  const int cols = k_tiles * 16, out_items = m * (total_cols / 128);
  if (x_bf16) launch_had_in_group((const __nv_bfloat16*)x, srcs, num, (half*)xh_all, m, cols, s);
  else launch_had_in_group((const half*)x, srcs, num, (half*)xh_all, m, cols, s);
  const half* xh = (const half*)xh_all;
  float* p = (float*)partial;
  int* c = (int*)counters;
  int code = [&]() -> int {
    if (wg)
      EXL3_DISPATCH(k2, codebook, launch_variant_gemm_group_wg, (xh, srcs, num, p, m, k_tiles, total_items, ring_mode,
                                                                 s))
    if (ring)
      EXL3_DISPATCH(k2, codebook, launch_variant_gemm_group_ring, (xh, srcs, num, p, m, k_tiles, total_items,
                                                                   ring_mode, c, out, y_bf16, total_cols, s))
    if (xs_slice > 0)
      EXL3_DISPATCH(k2, codebook, launch_variant_gemm_group_xs, (xh, srcs, num, p, m, k_tiles, total_items, xs_slice,
                                                                 s))
    EXL3_DISPATCH(k2, codebook, launch_variant_gemm_group, (xh, srcs, num, p, m, k_tiles, total_items, s))
  }();
  if (code != 0 || c != nullptr) return code;
  auto rotate_out = [&](auto* o) {
    if (use_octet(out_items, true))
      launch_plain(had_out_group_octet_kernel<elem_t<decltype(o)>>, dim3(octet_grid(out_items)), 256, 0, s, p, srcs,
                   num, o, m, total_cols);
    else
      launch_plain(had_out_group_kernel<elem_t<decltype(o)>>, dim3((out_items + 7) / 8), 256, 0, s, p, srcs, num, o, m,
                   total_cols);
  };
  if (y_bf16) rotate_out((__nv_bfloat16*)out);
  else rotate_out((half*)out);
  return (int)cudaGetLastError();
}

// exl3_group_linear on the wgmma ring in two launches, for m <= 64: the input rotation, then the GEMM with the
// `splits` K splits of each 128-column block in one thread-block cluster, summed through distributed shared memory and
// rotated into y inside the launch (gemm_group_wg_cluster_kernel): no partials. Every source of the table must have
// `splits` splits (1-8); y is then bit-identical to exl3_group_linear's on the wgmma ring over the same table.
int exl3_group_linear_cluster(const void* x, int x_bf16, const void* table, int num, void* xh_all, void* out,
                              int y_bf16, int m, int k_tiles, int total_items, int total_cols, int splits, int k2,
                              int codebook, void* stream) {
  if (m <= 0 || m > 64 || num <= 0 || k_tiles <= 0 || total_items <= 0 || total_cols <= 0 || total_cols % 128 ||
      splits < 1 || splits > kMaxClusterSplits || total_items % (8 * splits))
    return -3;
  if (g_wgmma != 1) return -1;
  auto s = (cudaStream_t)stream;
  auto srcs = (const GroupSource*)table;
  if (x_bf16) launch_had_in_group((const __nv_bfloat16*)x, srcs, num, (half*)xh_all, m, k_tiles * 16, s);
  else launch_had_in_group((const half*)x, srcs, num, (half*)xh_all, m, k_tiles * 16, s);
  const half* xh = (const half*)xh_all;
  EXL3_DISPATCH(k2, codebook, launch_variant_gemm_group_wg_cluster, (xh, srcs, num, out, y_bf16, m, k_tiles,
                                                                     total_items, total_cols, splits, s))
}

// exl3_group_linear in one launch (linear_decode_kernel): y[m, total_cols] for a same-input group (one source: a
// single linear), x and y both fp16 or both bf16 (bf16: the values of casting around an fp16 call). Every source's
// splits must cut K into whole 128-blocks ((k_tiles / 8) % splits == 0) and its N be a multiple of 128: the caller's
// table guarantees it (the kernel cannot check a device table). Scratch: partial fp32 [sum_s splits_s * N_s * m];
// counters int32 [total_cols / 128], zero, and left zero. xs_slice: the longest K slice of any source, in tiles
// (sizes the shared memory). warps: 4 or 8 per block (each block rotates its slice of x, so 8 halve that work);
// pdl: launched as a programmatic dependent of the kernel before it. xh_all (fp16 [num, m, K] scratch, or nullptr):
// the two-launch form, x rotated once per source by its own launch first (the same values, so the same output).
int exl3_linear_decode(const void* x, int bf16, void* xh_all, const void* table, int num, void* partial,
                       void* counters, long long counters_len, void* out, int m, int k_tiles, int total_items,
                       int total_cols, int k2, int codebook, int xs_slice, int warps, int pdl, void* stream) {
  if (m <= 0 || m > kOneLaunchMaxRows || num <= 0 || k_tiles <= 0 || k_tiles % 8 || total_items <= 0 ||
      total_cols <= 0 || total_cols % 128 || xs_slice <= 0 || xs_slice % 8 || counters_len < total_cols / 128)
    return -3;
  auto s = (cudaStream_t)stream;
  auto srcs = (const GroupSource*)table;
  auto p = (float*)partial;
  auto c = (int*)counters;
  EXL3_DISPATCH(k2, codebook, launch_variant_linear_decode, (x, bf16, (half*)xh_all, srcs, num, p, c, out, m, k_tiles,
                                                             total_items, total_cols, xs_slice, warps, pdl, s))
}

// A whole MoE forward over prepared tables in five launches (per-pair or expert-sorted sources, see the fused MoE
// stages above): input rotation and GEMM of the 2S gate/up sources, moe_mid, the down GEMM, moe_tail. x fp16 or
// bf16 [*, H] as the gate/up table's x_row fields address it; out fp32 [tokens, H]. Scratch: xh_gu fp16 [2S, rows,
// H], partial_gu fp32 (the gate/up table's partials x rows), xh_dn fp16 [S, rows, I], partial_dn fp32 likewise.
int exl3_moe_fused(const void* x, int x_bf16, const void* gu_table, const void* dn_table, int sources, int rows,
                   int hidden, int inter, int gu_items, int dn_items, int gu_k2, int gu_codebook, int dn_k2,
                   int dn_codebook, void* xh_gu, void* partial_gu, void* xh_dn, void* partial_dn,
                   const void* pair_rows, const void* w, const void* ids, int ids_bytes, int tokens, int topk,
                   int gelu, int gu_xs_slice, int dn_xs_slice, void* out, void* stream) {
  if (sources <= 0 || rows <= 0 || rows > 64 || hidden <= 0 || hidden % 128 || inter <= 0 || inter % 128 ||
      gu_items <= 0 || dn_items <= 0 || tokens <= 0 || topk <= 0 || topk > kMaxFusedTopk || (ids_bytes != 4 && ids_bytes != 8))
    return -3;
  auto s = (cudaStream_t)stream;
  auto gu = (const GroupSource*)gu_table;
  auto dn = (const GroupSource*)dn_table;
  if (x_bf16) launch_had_in_group((const __nv_bfloat16*)x, gu, 2 * sources, (half*)xh_gu, rows, hidden, s);
  else launch_had_in_group((const half*)x, gu, 2 * sources, (half*)xh_gu, rows, hidden, s);
  const half* xg = (const half*)xh_gu;
  float* pg = (float*)partial_gu;
  int code = [&]() -> int {
    if (gu_xs_slice > 0)
      EXL3_DISPATCH(gu_k2, gu_codebook, launch_variant_gemm_group_xs,
                    (xg, gu, 2 * sources, pg, rows, hidden / 16, gu_items, gu_xs_slice, s))
    EXL3_DISPATCH(gu_k2, gu_codebook, launch_variant_gemm_group,
                  (xg, gu, 2 * sources, pg, rows, hidden / 16, gu_items, s))
  }();
  if (code != 0) return code;
  const int mid_items = sources * rows * (inter / 128);
  moe_mid_kernel<<<(mid_items + kMidItems - 1) / kMidItems, 2 * kMidItems * 32, 0, s>>>(pg, gu, dn, sources, rows,
                                                                                      inter, (half*)xh_dn, gelu);
  const half* xd = (const half*)xh_dn;
  float* pd = (float*)partial_dn;
  code = [&]() -> int {
    if (dn_xs_slice > 0)
      EXL3_DISPATCH(dn_k2, dn_codebook, launch_variant_gemm_group_xs,
                    (xd, dn, sources, pd, rows, inter / 16, dn_items, dn_xs_slice, s))
    EXL3_DISPATCH(dn_k2, dn_codebook, launch_variant_gemm_group, (xd, dn, sources, pd, rows, inter / 16, dn_items, s))
  }();
  if (code != 0) return code;
  const int tail_warps = topk < 8 ? topk : 8;
  moe_tail_kernel<<<tokens * (hidden / 128), tail_warps * 32, 0, s>>>(pd, dn, (const long long*)pair_rows, rows,
                                                                      (const float*)w, ids, ids_bytes, (float*)out,
                                                                      topk, hidden);
  return (int)cudaGetLastError();
}

// A whole MoE forward for one source per (token, expert) pair in two launches (see moe_decode_gu_kernel): x fp16
// or bf16 [tokens, hidden]; gate/up/down: bank rows (GroupSource layout, one per local expert); splits must cut K
// into whole 128-blocks (hidden / 128 and inter / 128 divisible by them). Scratch: partial_gu fp32 [pairs * 2 *
// gu_splits * inter], xh_dn fp16 [pairs * inter], partial_dn fp32 [pairs * dn_splits * hidden], counters int32
// [counters_len >= pairs * inter / 128 + tokens * hidden / 128], zero on entry and left zero. out: fp32, fp16 or bf16
// (out_kind 0 / 1 / 2) [tokens, hidden].
int exl3_moe_decode(const void* x, int x_bf16, const void* gate_rows, const void* up_rows, const void* down_rows,
                    const void* ids, int ids_bytes, const void* w, int tokens, int topk, int hidden, int inter,
                    int gu_k2, int gu_codebook, int dn_k2, int dn_codebook, int gu_splits, int dn_splits,
                    void* partial_gu, void* xh_dn, void* partial_dn, void* counters, long long counters_len,
                    int gelu, void* out, int out_kind, int pdl, void* stream) {
  if (tokens <= 0 || topk <= 0 || topk > kMaxFusedTopk || hidden <= 0 || hidden % 128 || inter <= 0 ||
      inter % 128 || gu_splits <= 0 || (hidden / 128) % gu_splits || dn_splits <= 0 || (inter / 128) % dn_splits ||
      (ids_bytes != 4 && ids_bytes != 8) || out_kind < 0 || out_kind > 2 ||
      counters_len < (long long)tokens * topk * (inter / 128) + (long long)tokens * (hidden / 128))
    return -3;
  MoeDecodeArgs a;
  a.x = x;
  a.gate = (const GroupSource*)gate_rows;
  a.up = (const GroupSource*)up_rows;
  a.down = (const GroupSource*)down_rows;
  a.ids = ids;
  a.w = (const float*)w;
  a.partial_gu = (float*)partial_gu;
  a.xh_dn = (half*)xh_dn;
  a.partial_dn = (float*)partial_dn;
  a.counters = (int*)counters;
  a.out = out;
  a.ids_bytes = ids_bytes;
  a.pairs = tokens * topk;
  a.topk = topk;
  a.hidden = hidden;
  a.inter = inter;
  a.gu_splits = gu_splits;
  a.dn_splits = dn_splits;
  a.gelu = gelu;
  a.out_kind = out_kind;
  auto s = (cudaStream_t)stream;
  const int code = [&]() -> int { EXL3_DISPATCH(gu_k2, gu_codebook, launch_variant_decode_gu, (a, x_bf16, s)) }();
  if (code != 0) return code;
  EXL3_DISPATCH(dn_k2, dn_codebook, launch_variant_decode_dn, (a, pdl, s))
}

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

// out fp16 [sources * rows, n] = act(gate) * up for the fp16 [rows, 2 * sources * n] output of a two-bank group
// (silu, or gelu's tanh approximation when `gelu`), rows regrouped source by source.
int exl3_act_mul(const void* gate_up, void* out, int sources, int rows, int n, int gelu, int on_host, void* stream) {
  if (sources < 0 || rows <= 0 || n <= 0 || !gate_up || !out) return -3;
  const long long count = (long long)sources * rows * n;
  if (count == 0) return 0;
  auto g = (const half*)gate_up;
  auto o = (half*)out;
  if (on_host) {
    for (long long i = 0; i < count; ++i) act_mul_one(g, o, sources, rows, n, i, gelu);
    return 0;
  }
  act_mul_kernel<<<(unsigned)((count + 255) / 256), 256, 0, (cudaStream_t)stream>>>(g, o, sources, rows, n, count,
                                                                                     gelu);
  return (int)cudaGetLastError();
}

// out fp32 [tokens, n] = the routing-weighted sum of each token's top-k rows of fp16 y; pair p's row starts at
// y + rows[p] (int64 element offsets; null: y + p * n); w fp32 [tokens * top-k]; pairs whose id is below 0 are
// skipped.
int exl3_moe_combine(const void* y, const void* rows, const void* w, const void* ids, int ids_bytes, void* out,
                     int tokens, int topk, int n, int on_host, void* stream) {
  if (tokens < 0 || topk <= 0 || n <= 0 || (ids_bytes != 4 && ids_bytes != 8)) return -3;
  if (tokens == 0) return 0;
  const long long count = (long long)tokens * n;
  auto yy = (const half*)y;
  auto rr = (const long long*)rows;
  auto ww = (const float*)w;
  auto o = (float*)out;
  if (on_host) {
    for (long long i = 0; i < count; ++i) combine_one(yy, rr, ww, ids, ids_bytes, o, topk, n, i);
    return 0;
  }
  combine_kernel<<<(unsigned)((count + 255) / 256), 256, 0, (cudaStream_t)stream>>>(yy, rr, ww, ids, ids_bytes, o,
                                                                                     topk, n, count);
  return (int)cudaGetLastError();
}

// The rotated slab's glue (slab_*_kernel above): x fp16 or bf16 [pairs / top-k, k]; suh / svh fp16 [experts,
// width] in slab order; ids int32 / int64 [pairs]; a fp16 [2 * pairs, k], c fp16 [2 * pairs, n], h fp16 [pairs, n],
// y fp16 [pairs, hidden], w and out fp32
unsigned slab_grid(long long blocks) {  // 8 warps of kSlabPerWarp 128-blocks each
  return (unsigned)((blocks + 8 * kSlabPerWarp - 1) / (8 * kSlabPerWarp));
}

int exl3_slab_rot_in(const void* x, int x_bf16, const void* ids, int ids_bytes, int pairs, int topk,
                     const void* gate_suh, const void* up_suh, void* a, int k, void* stream) {
  if (pairs <= 0 || topk <= 0 || pairs % topk || k <= 0 || k % 128 || (ids_bytes != 4 && ids_bytes != 8)) return -3;
  const long long items = 2LL * pairs * (k / 128);
  auto launch = [&](auto* xp) {
    slab_rot_in_kernel<<<slab_grid(items), 256, 0, (cudaStream_t)stream>>>(
        xp, ids, ids_bytes, pairs, topk, (const half*)gate_suh, (const half*)up_suh, (half*)a, k);
  };
  if (x_bf16) launch((const __nv_bfloat16*)x);
  else launch((const half*)x);
  return (int)cudaGetLastError();
}

int exl3_slab_mid(const void* c, const void* ids, int ids_bytes, int pairs, const void* gate_svh, const void* up_svh,
                  const void* down_suh, void* h, int n, int gelu, void* stream) {
  if (pairs <= 0 || n <= 0 || n % 128 || (ids_bytes != 4 && ids_bytes != 8)) return -3;
  slab_mid_kernel<<<slab_grid((long long)pairs * (n / 128)), 256, 0, (cudaStream_t)stream>>>(
      (const half*)c, ids, ids_bytes, pairs, (const half*)gate_svh, (const half*)up_svh, (const half*)down_suh,
      (half*)h, n, gelu);
  return (int)cudaGetLastError();
}

int exl3_slab_tail(const void* y, const void* ids, int ids_bytes, const void* w, const void* down_svh, void* out,
                   int tokens, int topk, int hidden, void* stream) {
  if (tokens <= 0 || topk <= 0 || hidden <= 0 || hidden % 128 || (ids_bytes != 4 && ids_bytes != 8)) return -3;
  slab_tail_kernel<<<slab_grid((long long)tokens * (hidden / 128)), 256, 0, (cudaStream_t)stream>>>(
      (const half*)y, ids, ids_bytes, (const float*)w, (const half*)down_svh, (float*)out, tokens, topk, hidden);
  return (int)cudaGetLastError();
}

// Host-side reading of a group table as the kernels read it (tests on machines without a GPU: the Python side's
// packing and the source lookup). table in host memory; out[0..6] = source of `item`, source of `col`, and that
// item's source's n_tiles, splits, x_row, item_begin, partial_base.
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

// Pins the form of every later rotation launch (0: by size, 1: one warp per 128-block, 2: eight threads per
// 128-block), for A/B measurements; the two forms give the same bits. Returns the previous form, or -3.
int exl3_set_had_form(int form) {
  if (form < kHadFormAuto || form > kHadFormOctet) return -3;
  const int before = g_had_form;
  g_had_form = form;
  return before;
}

// The three-launch path's rotations and x-slice GEMMs as programmatic dependents (1) or plain launches (0), for every
// later launch of the process (launch_plain; the same bits either way); a negative value only asks. Returns the
// previous setting, or -3.
int exl3_set_plain_pdl(int on) {
  if (on > 1) return -3;
  const int before = g_plain_pdl;
  if (on >= 0) g_plain_pdl = on;
  return before;
}

// 1 where programmatic launches are used at all (pdl_usable: a PDL device and kernels built with the waits), else 0;
// the PDL switches only ask for them
int exl3_pdl_usable(void) { return pdl_usable(); }

// The size (in 128-blocks of one launch) from which kHadFormAuto takes the octet form; returns the previous one
long long exl3_set_octet_min_items(long long items) {
  const long long before = g_octet_min_items;
  if (items >= 0) g_octet_min_items = items;
  return before;
}

// 1 where this build has the wgmma ring kernels for the current GPU (compiled for sm_90a and running on it), else 0;
// below -1000: -1000 - a CUDA error. Runs a probe kernel and synchronizes, so call it outside graph capture; the
// wgmma ring modes are refused until it has answered 1.
int exl3_wgmma_available(void) {
  int* flag = nullptr;
  int got = 0;
  cudaError_t e = cudaMalloc(&flag, sizeof(int));
  if (e != cudaSuccess) return -1000 - (int)e;
  wgmma_probe_kernel<<<1, 1>>>(flag);
  e = cudaMemcpy(&got, flag, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(flag);
  if (e != cudaSuccess) return -1000 - (int)e;
  g_wgmma = got;
  return got;
}

int exl3_abi_version(void) { return 29; }

const char* exl3_error_string(int code) {
  switch (code) {
    case -1: return "unsupported bitrate/codebook pair";
    case -2: return "m too large for the fused kernel (at most 64 rows)";
    case -3: return "bad shape or argument";
    default: return cudaGetErrorString((cudaError_t)code);
  }
}

}  // extern "C"

// -----------------------------------------------------------------------------------------------------------------
// Trellis encoding: the tail-biting Viterbi search of codec/encode.py, one block per 16x16 tile, bit for bit the same
// path (the same fp32 operations with no contraction, the lowest index among equal errors, the same two passes: from
// the middle of the ring to find the edge crossing position 0, then from that edge back to it).

namespace {

constexpr int kEncThreads = 1024;

__device__ __forceinline__ float enc_err(float value, float x) {
  const float d = __fsub_rn(value, x);
  return __fmul_rn(d, d);
}

__device__ __forceinline__ bool enc_better(float v, int i, float best, int best_i) {
  return v < best || (v == best && i < best_i);
}

// The lowest index of least cost among cost[0, n), by the encoders' tie rule, reduced over the block; the result is
// valid in thread 0 only. s_val / s_idx: one shared slot per warp. Ends after a barrier that its callers' next
// barrier orders against.
__device__ __forceinline__ int block_argmin(const float* cost, int n, float* s_val, int* s_idx) {
  float best = INFINITY;
  int best_i = 1 << 30;
  for (int e = threadIdx.x; e < n; e += blockDim.x)
    if (enc_better(cost[e], e, best, best_i)) {
      best = cost[e];
      best_i = e;
    }
  for (int off = 16; off > 0; off >>= 1) {
    const float v = __shfl_down_sync(0xffffffffu, best, off);
    const int i = __shfl_down_sync(0xffffffffu, best_i, off);
    if (enc_better(v, i, best, best_i)) {
      best = v;
      best_i = i;
    }
  }
  if ((threadIdx.x & 31) == 0) {
    s_val[threadIdx.x >> 5] = best;
    s_idx[threadIdx.x >> 5] = best_i;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < (int)(blockDim.x + 31) / 32; ++w)
      if (enc_better(s_val[w], s_idx[w], best, best_i)) {
        best = s_val[w];
        best_i = s_idx[w];
      }
  return best_i;
}

__global__ void __launch_bounds__(kEncThreads)
quantize_tiles_kernel(const float* __restrict__ x, const float* __restrict__ table, int* __restrict__ states,
                      float* __restrict__ cost_scratch, uint16_t* __restrict__ back_scratch, int k) {
  const int kr = 16 - k;
  const int edges = 1 << kr;
  const int hi_count = 1 << k;
  const float* xt = x + (size_t)blockIdx.x * 256;
  float* cost0 = cost_scratch + (size_t)blockIdx.x * 2 * edges;
  float* cost1 = cost0 + edges;
  uint16_t* back = back_scratch + (size_t)blockIdx.x * 256 * edges;
  __shared__ float s_val[32];
  __shared__ int s_idx[32];
  __shared__ int s_edge;

  // 256 steps from position `roll`; pre >= 0: the edge every path comes from. Returns the buffer of final costs.
  auto forward = [&](int roll, int pre) -> const float* {
    float* prev = cost0;
    float* cur = cost1;
    for (int i = 0; i < 256; ++i) {
      const int pos = (i + roll) & 255;
      const float xv = xt[pos];
      for (int e = threadIdx.x; e < edges; e += blockDim.x) {
        float best = 0.f;
        int best_in = 0;
        for (int hi = 0; hi < hi_count; ++hi) {
          const int state = (hi << kr) | e;
          const int in_edge = state >> k;
          float err = enc_err(table[state], xv);
          if (i > 0) err = __fadd_rn(err, prev[in_edge]);
          else if (pre >= 0 && in_edge != pre) err = INFINITY;
          if (hi == 0 || err < best) {
            best = err;
            best_in = in_edge;
          }
        }
        cur[e] = best;
        back[(size_t)pos * edges + e] = (uint16_t)best_in;
      }
      __syncthreads();
      float* t = prev;
      prev = cur;
      cur = t;
    }
    return prev;
  };

  // The lowest-index edge of least cost, in every thread.
  auto argmin = [&](const float* cost) -> int {
    const int best_i = block_argmin(cost, edges, s_val, s_idx);
    if (threadIdx.x == 0) s_edge = best_i;
    __syncthreads();
    return s_edge;
  };

  // Walk the backpointers from `edge` at step `last` of a pass from `roll` down to step `first`; returns the edge the
  // path came from before step `first`, in every thread (and writes the states when asked).
  auto backtrack = [&](int roll, int edge, int first, int last, bool write) -> int {
    if (threadIdx.x == 0) {
      for (int j = last; j >= first; --j) {
        const int pos = (j + roll) & 255;
        const int prev = back[(size_t)pos * edges + edge];
        if (write) states[(size_t)blockIdx.x * 256 + pos] = ((prev << k) | edge) & 0xffff;
        edge = prev;
      }
      s_edge = edge;
    }
    __syncthreads();
    return s_edge;
  };

  const int end = argmin(forward(128, -1));
  const int crossing = backtrack(128, end, 128, 255, false);  // steps 128..255 of that pass are positions 0..127
  forward(0, crossing);
  backtrack(0, crossing, 0, 255, true);
}

// The same search, organised so that it is bound by arithmetic rather than memory (K = 2..8): the codebook values are
// computed in registers (decode_pair, as the GEMMs decode them) instead of read from a 256 KiB table; the costs live in
// shared memory; the first pass keeps no backpointers at all but carries, per state, the in-edge its survivor chose at
// position 0 (the same edge the backtrack of the plain kernel finds); the second pass runs forward once, storing its
// costs at segment starts (kEncSeg steps apart) into a small per-block scratch, then recomputes the segments last to
// first with their branch choices (one byte per state) in shared memory and walks them back. Recomputing from a stored
// cost vector repeats the same fp32 operations, so every choice, and the path, equal the plain kernel's. Blocks are
// persistent (one per SM), so each block reuses its scratch and it stays in L2.
template <int K>
struct EncShape {
  static constexpr int kr = 16 - K, edges = 1 << kr, his = 1 << K;
  static constexpr int threads = edges < 512 ? edges : 512;
  static constexpr int per_thread = edges / threads;
  static constexpr int hist_bytes = K == 2 ? 64 * 1024 : 128 * 1024;  // a segment's branch bytes, at most
  static constexpr int seg = hist_bytes / edges < 256 ? hist_bytes / edges : 256;
  static constexpr int segs = 256 / seg;
  static constexpr int branch_bytes = seg * edges > 4 * edges ? seg * edges : 4 * edges;  // or pass 1's two tags
  static constexpr int smem = 2 * edges * 4 + branch_bytes;  // two cost buffers, then the branches
};

template <int K>
constexpr long long enc_scratch_floats() {  // per block: one cost vector per segment start
  return (long long)EncShape<K>::segs * EncShape<K>::edges;
}

template <int K, int CB>
__global__ void __launch_bounds__(EncShape<K>::threads, 1)
quantize_tiles_fast_kernel(const float* __restrict__ x, int* __restrict__ states, float* __restrict__ snaps, int tiles) {
  using S = EncShape<K>;
  extern __shared__ __align__(16) unsigned char enc_smem[];
  float* cost_a = reinterpret_cast<float*>(enc_smem);
  float* cost_b = cost_a + S::edges;
  uint8_t* hist = reinterpret_cast<uint8_t*>(cost_b + S::edges);
  uint16_t* tag_a = reinterpret_cast<uint16_t*>(hist);  // pass 1 only
  uint16_t* tag_b = tag_a + S::edges;
  __shared__ float xs[256];
  __shared__ float r_val[32];
  __shared__ int r_idx[32];
  __shared__ int r_edge;
  float* snap = snaps + (size_t)blockIdx.x * S::segs * S::edges;

  // One trellis step for this thread's out-edges: prev -> cur costs; `branch(e, hi)` sees each choice.
  auto step = [&](int i, float xv, const float* prev, float* cur, int pre, auto&& branch) {
    for (int j = 0; j < S::per_thread; ++j) {
      const int e = threadIdx.x + j * S::threads;
      float best = 0.f;
      int best_hi = 0;
#pragma unroll 8
      for (int hi = 0; hi < S::his; hi += 2) {
        const uint32_t pair = decode_pair<CB>((uint32_t)((hi << S::kr) | e), (uint32_t)(((hi + 1) << S::kr) | e));
        const float2 v = __half22float2(*reinterpret_cast<const half2*>(&pair));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int in_edge = (((hi + h) << S::kr) | e) >> K;
          float err = enc_err(h ? v.y : v.x, xv);
          if (i > 0) err = __fadd_rn(err, prev[in_edge]);
          else if (pre >= 0 && in_edge != pre) err = INFINITY;
          if ((hi + h) == 0 || err < best) {
            best = err;
            best_hi = hi + h;
          }
        }
      }
      cur[e] = best;
      branch(e, best_hi);
    }
  };

  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) xs[i] = x[(size_t)tile * 256 + i];
    __syncthreads();

    // Pass 1 from position 128: the survivor's in-edge at position 0 rides along as a tag.
    float *prev = cost_a, *cur = cost_b;
    uint16_t *tprev = tag_a, *tcur = tag_b;
    for (int i = 0; i < 256; ++i) {
      step(i, xs[(i + 128) & 255], prev, cur, -1, [&](int e, int hi) {
        const int in_edge = ((hi << S::kr) | e) >> K;
        if (i == 128) tcur[e] = (uint16_t)in_edge;
        else if (i > 128) tcur[e] = tprev[in_edge];
      });
      __syncthreads();
      float* t = prev; prev = cur; cur = t;
      uint16_t* u = tprev; tprev = tcur; tcur = u;
    }
    // The lowest-index edge of least final cost; its tag is the crossing edge.
    {
      const int best_i = block_argmin(prev, S::edges, r_val, r_idx);
      if (threadIdx.x == 0) r_edge = tprev[best_i];
      __syncthreads();
    }
    const int crossing = r_edge;

    // Pass 2 from position 0, every path leaving the crossing edge: forward to the last segment, storing the costs at
    // each segment start, then the segments last to first.
    prev = cost_a; cur = cost_b;
    for (int i = 0; i < (S::segs - 1) * S::seg; ++i) {
      step(i, xs[i], prev, cur, crossing, [](int, int) {});
      __syncthreads();
      float* t = prev; prev = cur; cur = t;
      if ((i + 1) % S::seg == 0)
        for (int e = threadIdx.x; e < S::edges; e += S::threads) snap[((i + 1) / S::seg) * S::edges + e] = prev[e];
    }
    int edge = crossing;  // the path ends on the edge it started from
    for (int sgi = S::segs - 1; sgi >= 0; --sgi) {
      prev = cost_a; cur = cost_b;
      if (sgi > 0) {
        __syncthreads();
        for (int e = threadIdx.x; e < S::edges; e += S::threads) prev[e] = snap[sgi * S::edges + e];
        __syncthreads();
      }
      const int i0 = sgi * S::seg;
      for (int i = i0; i < i0 + S::seg; ++i) {
        uint8_t* row = hist + (size_t)(i - i0) * S::edges;
        step(i, xs[i], prev, cur, crossing, [&](int e, int hi) { row[e] = (uint8_t)hi; });
        __syncthreads();
        float* t = prev; prev = cur; cur = t;
      }
      if (threadIdx.x == 0)
        for (int i = i0 + S::seg - 1; i >= i0; --i) {
          const int state = (hist[(size_t)(i - i0) * S::edges + edge] << S::kr) | edge;
          states[(size_t)tile * 256 + i] = state;
          edge = state >> K;
        }
      __syncthreads();
    }
  }
}

// tiles > 0: launch on at most `blocks` persistent blocks; tiles == 0: store in *blocks how many are resident at
// once on this device (the scratch the caller allocates).
template <int K, int CB>
int launch_quantize_fast(const float* x, int* states, float* snaps, int tiles, int* blocks, cudaStream_t stream) {
  using S = EncShape<K>;
  auto kernel = quantize_tiles_fast_kernel<K, CB>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::smem);
  if (err != cudaSuccess) return (int)err;
  if (tiles == 0) {
    int device = 0, sms = 0, per_sm = 0;
    if ((err = cudaGetDevice(&device)) != cudaSuccess) return (int)err;
    if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return (int)err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, S::threads, S::smem);
    if (err != cudaSuccess) return (int)err;
    *blocks = sms * (per_sm > 0 ? per_sm : 1);
    return 0;
  }
  kernel<<<tiles < *blocks ? tiles : *blocks, S::threads, S::smem, stream>>>(x, states, snaps, tiles);
  return (int)cudaGetLastError();
}

template <int CB>
int quantize_fast_cb(const float* x, int* states, float* snaps, int tiles, int k, int* blocks, cudaStream_t stream) {
  switch (k) {
    case 2: return launch_quantize_fast<2, CB>(x, states, snaps, tiles, blocks, stream);
    case 3: return launch_quantize_fast<3, CB>(x, states, snaps, tiles, blocks, stream);
    case 4: return launch_quantize_fast<4, CB>(x, states, snaps, tiles, blocks, stream);
    case 5: return launch_quantize_fast<5, CB>(x, states, snaps, tiles, blocks, stream);
    case 6: return launch_quantize_fast<6, CB>(x, states, snaps, tiles, blocks, stream);
    case 7: return launch_quantize_fast<7, CB>(x, states, snaps, tiles, blocks, stream);
    case 8: return launch_quantize_fast<8, CB>(x, states, snaps, tiles, blocks, stream);
    default: return -3;
  }
}

}  // namespace

extern "C" {

// states[t, 256] (int32, position order) of the tail-biting path of least squared error for tiles x[t, 256] (fp32,
// position order) against the codebook values `table` (fp32 [65536]); K in 1..8. Scratch: cost fp32
// [tiles, 2, 2^(16-K)], back uint16 [tiles, 256, 2^(16-K)] (the caller chunks the tiles to bound it).
int exl3_quantize_tiles(const void* x, const void* table, void* states, void* cost_scratch, void* back_scratch,
                        int tiles, int k, void* stream) {
  if (tiles <= 0 || k < 1 || k > 8) return -3;
  const int threads = (1 << (16 - k)) < kEncThreads ? (1 << (16 - k)) : kEncThreads;
  quantize_tiles_kernel<<<tiles, threads, 0, (cudaStream_t)stream>>>(
      (const float*)x, (const float*)table, (int*)states, (float*)cost_scratch, (uint16_t*)back_scratch, k);
  return (int)cudaGetLastError();
}

// The same states as exl3_quantize_tiles for K in 2..8, computed by quantize_tiles_fast_kernel with codebook `cb`
// (0 3INST, 1 MCG, 2 MUL1) on at most `blocks` persistent blocks; snaps: fp32 scratch of
// exl3_quantize_tiles_fast_scratch(k) floats per block. tiles == 0 asks instead: *blocks_out = the blocks resident at
// once on the current device.
int exl3_quantize_tiles_fast(const void* x, void* states, void* snaps, int tiles, int k, int cb, int blocks,
                             int* blocks_out, void* stream) {
  if (tiles < 0 || k < 2 || k > 8 || cb < 0 || cb > 2 || (tiles > 0 && blocks <= 0)) return -3;
  int* b = tiles == 0 ? blocks_out : &blocks;
  if (b == nullptr) return -3;
  const float* xf = (const float*)x;
  cudaStream_t s = (cudaStream_t)stream;
  if (cb == 0) return quantize_fast_cb<0>(xf, (int*)states, (float*)snaps, tiles, k, b, s);
  if (cb == 1) return quantize_fast_cb<1>(xf, (int*)states, (float*)snaps, tiles, k, b, s);
  return quantize_fast_cb<2>(xf, (int*)states, (float*)snaps, tiles, k, b, s);
}

long long exl3_quantize_tiles_fast_scratch(int k) {
  switch (k) {
    case 2: return enc_scratch_floats<2>();
    case 3: return enc_scratch_floats<3>();
    case 4: return enc_scratch_floats<4>();
    case 5: return enc_scratch_floats<5>();
    case 6: return enc_scratch_floats<6>();
    case 7: return enc_scratch_floats<7>();
    case 8: return enc_scratch_floats<8>();
    default: return -3;
  }
}

}  // extern "C"
