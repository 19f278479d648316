// The trellis decode every kernel family shares: a lane's bits of a 16x16 tile, the codebooks, the states.
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
#pragma once

#include "base.cuh"

namespace exl3 {
namespace {  // device code and launch helpers: private to each translation unit

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

}  // namespace
}  // namespace exl3
