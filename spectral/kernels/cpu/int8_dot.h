// The integer path's one product: unsigned weight bytes times signed activation bytes, each
// group of four products summed into the 32-bit lane that holds them. Two ways to keep the sums
// (quant_int8_tiles.cpp's tiles are written once against this interface):
//
//   AVX2:  `maddubs` adds the products in pairs into int16, the caller's int16 accumulator
//          takes several of those (each layout's bound keeps them exact), and `widen` adds
//          neighbouring int16 into int32 at the end;
//   VNNI:  `vpdpbusd` adds all four products straight into an int32 accumulator (AVX-512 VNNI,
//          or AVX-VNNI at 256 bits), and `widen` has nothing left to do.
//
// The sums are the same integers either way. The vectors are 512 bits wide where the CPU has
// AVX-512 BW (16 columns of a panel a vector), 256 bits otherwise (8 columns); `iv` holds the
// few operations the tiles use in both widths. SPECTRAL_VNNI_EMULATED builds the VNNI form from
// AVX2 instructions (exact products in int16, no pair saturation), so the VNNI tiles' code runs
// and is tested on CPUs without the instruction. Free of torch: tests compile it alone under
// each instruction set's flags.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace spectral_cpu {

#if defined(__AVX2__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(SPECTRAL_VNNI_EMULATED)
#define SPECTRAL_INT8_BITS 512
#if defined(__AVX512VNNI__)
#define SPECTRAL_VNNI 1
#endif
#elif defined(__AVX2__)
#define SPECTRAL_INT8_BITS 256
#if defined(SPECTRAL_VNNI_EMULATED) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || \
    defined(__AVXVNNI__)
#define SPECTRAL_VNNI 1
#endif
#endif

// 1: the tiles use VNNI instructions, 2: their AVX2 emulation, 0: maddubs and int16 sums.
constexpr int kVnni =
#if defined(SPECTRAL_VNNI_EMULATED)
    2;
#elif defined(SPECTRAL_VNNI)
    1;
#else
    0;
#endif

#if defined(SPECTRAL_INT8_BITS)
#if SPECTRAL_INT8_BITS == 512
using IVec = __m512i;
using FVec = __m512;
#else
using IVec = __m256i;
using FVec = __m256;
#endif
// The 32-bit lanes of a vector: how many columns of a panel one vector holds.
constexpr int kIntLanes = sizeof(IVec) / 4;

// The tiles' operations in the vectors' width: integer lanes of 8, 16 or 32 bits as named,
// loads and stores unaligned, shifts by counts the inlined callers make constants.
namespace iv {
#if SPECTRAL_INT8_BITS == 512
inline IVec load(const void* p) { return _mm512_loadu_si512(p); }
inline IVec zero() { return _mm512_setzero_si512(); }
inline IVec bytes(int8_t c) { return _mm512_set1_epi8(c); }
inline IVec pairs(int16_t c) { return _mm512_set1_epi16(c); }
inline IVec words(int32_t c) { return _mm512_set1_epi32(c); }
inline IVec and_(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec or_(IVec a, IVec b) { return _mm512_or_si512(a, b); }
inline IVec xor_(IVec a, IVec b) { return _mm512_xor_si512(a, b); }
inline IVec srl16(IVec a, int n) { return _mm512_srli_epi16(a, n); }
inline IVec sll16(IVec a, int n) { return _mm512_slli_epi16(a, n); }
inline IVec sll32(IVec a, int n) { return _mm512_slli_epi32(a, n); }
inline IVec sra32(IVec a, int n) { return _mm512_srai_epi32(a, n); }
inline IVec sll32(IVec a, __m128i n) { return _mm512_sll_epi32(a, n); }
inline IVec add32(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec sub32(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
inline IVec add16(IVec a, IVec b) { return _mm512_add_epi16(a, b); }
inline IVec sub16(IVec a, IVec b) { return _mm512_sub_epi16(a, b); }
inline IVec sub8(IVec a, IVec b) { return _mm512_sub_epi8(a, b); }
inline IVec mullo32(IVec a, IVec b) { return _mm512_mullo_epi32(a, b); }
inline IVec madd16(IVec a, IVec b) { return _mm512_madd_epi16(a, b); }
inline IVec maddubs(IVec u, IVec s) { return _mm512_maddubs_epi16(u, s); }
inline IVec abs8(IVec a) { return _mm512_abs_epi8(a); }
// x negated where w < 0, zero where w == 0 (AVX2's vpsignb, which AVX-512 has not).
inline IVec sign8(IVec x, IVec w) {
  const IVec flipped = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), zero(), x);
  return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(w, w), flipped);
}
// kIntLanes bytes at p, each widened to its lane (unsigned or signed).
inline IVec u8_lanes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline IVec i8_lanes(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// kIntLanes bytes at a and at b, a lane holding a[i] in its low int16 and b[i] in its high.
inline IVec u8_pair_lanes(const uint8_t* a, const uint8_t* b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(x, y), _mm_unpacklo_epi8(x, y)));
}
inline int32_t first_lane(IVec a) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(a)); }
inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec fset1(float v) { return _mm512_set1_ps(v); }
inline FVec fload(const float* p) { return _mm512_loadu_ps(p); }
inline void fstore(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline FVec fadd(FVec a, FVec b) { return _mm512_add_ps(a, b); }
inline FVec fmul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec to_float(IVec a) { return _mm512_cvtepi32_ps(a); }
// kIntLanes float16 at p, as float32.
inline FVec half_lanes(const void* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}
#else
inline IVec load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline IVec zero() { return _mm256_setzero_si256(); }
inline IVec bytes(int8_t c) { return _mm256_set1_epi8(c); }
inline IVec pairs(int16_t c) { return _mm256_set1_epi16(c); }
inline IVec words(int32_t c) { return _mm256_set1_epi32(c); }
inline IVec and_(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec or_(IVec a, IVec b) { return _mm256_or_si256(a, b); }
inline IVec xor_(IVec a, IVec b) { return _mm256_xor_si256(a, b); }
inline IVec srl16(IVec a, int n) { return _mm256_srli_epi16(a, n); }
inline IVec sll16(IVec a, int n) { return _mm256_slli_epi16(a, n); }
inline IVec sll32(IVec a, int n) { return _mm256_slli_epi32(a, n); }
inline IVec sra32(IVec a, int n) { return _mm256_srai_epi32(a, n); }
inline IVec sll32(IVec a, __m128i n) { return _mm256_sll_epi32(a, n); }
inline IVec add32(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec sub32(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
inline IVec add16(IVec a, IVec b) { return _mm256_add_epi16(a, b); }
inline IVec sub16(IVec a, IVec b) { return _mm256_sub_epi16(a, b); }
inline IVec sub8(IVec a, IVec b) { return _mm256_sub_epi8(a, b); }
inline IVec mullo32(IVec a, IVec b) { return _mm256_mullo_epi32(a, b); }
inline IVec madd16(IVec a, IVec b) { return _mm256_madd_epi16(a, b); }
inline IVec maddubs(IVec u, IVec s) { return _mm256_maddubs_epi16(u, s); }
inline IVec abs8(IVec a) { return _mm256_abs_epi8(a); }
inline IVec sign8(IVec x, IVec w) { return _mm256_sign_epi8(x, w); }
inline IVec u8_lanes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline IVec i8_lanes(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline IVec u8_pair_lanes(const uint8_t* a, const uint8_t* b) {
  return _mm256_cvtepu8_epi16(
      _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}
inline int32_t first_lane(IVec a) { return _mm256_extract_epi32(a, 0); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec fset1(float v) { return _mm256_set1_ps(v); }
inline FVec fload(const float* p) { return _mm256_loadu_ps(p); }
inline void fstore(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline FVec fadd(FVec a, FVec b) { return _mm256_add_ps(a, b); }
inline FVec fmul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec to_float(IVec a) { return _mm256_cvtepi32_ps(a); }
inline FVec half_lanes(const void* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
#endif
// The 4 bytes at p in every lane.
inline IVec bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return words(v);
}
// c in both int16 halves of each lane (c sign-extended to int32 in its lane).
inline IVec both_halves(IVec c) { return or_(and_(c, words(0xFFFF)), sll32(c, 16)); }
}  // namespace iv

// acc + for each 32-bit lane the sum of its four products u8 * s8, exactly.
inline IVec dot4_add(IVec acc, IVec u, IVec s) {
#if defined(SPECTRAL_VNNI_EMULATED)
  const IVec low = iv::pairs(0x00FF);
  const IVec u_even = iv::and_(u, low), u_odd = iv::srl16(u, 8);
  const IVec s_even = _mm256_srai_epi16(iv::sll16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
  return iv::add32(acc, iv::add32(iv::madd16(u_even, s_even), iv::madd16(u_odd, s_odd)));
#elif defined(SPECTRAL_VNNI) && SPECTRAL_INT8_BITS == 512
  return _mm512_dpbusd_epi32(acc, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return iv::add32(acc, iv::madd16(iv::maddubs(u, s), iv::pairs(1)));
#endif
}

// An accumulator of products in the lanes' natural width: int16 pairs on AVX2 (the caller
// keeps their sums within int16), int32 lanes with VNNI.
struct DotSum {
  IVec v = iv::zero();
  // v + the products of u and s
  void add(IVec u, IVec s) {
#if defined(SPECTRAL_VNNI)
    v = dot4_add(v, u, s);
#else
    v = iv::add16(v, iv::maddubs(u, s));
#endif
  }
  // the int32 sums of each lane's four products
  IVec widen() const {
#if defined(SPECTRAL_VNNI)
    return v;
#else
    return iv::madd16(v, iv::pairs(1));
#endif
  }
  // widen() times each lane's scale, which `scale` holds in both int16 halves of the lane
  // (exact: the int16 sums are, and so are their products with it in int32).
  IVec widen_scaled(IVec scale) const {
#if defined(SPECTRAL_VNNI)
    return iv::mullo32(v, iv::sra32(scale, 16));
#else
    return iv::madd16(v, scale);
#endif
  }
  // What a sum that is to come out as its products' sum less c starts at, in the lanes'
  // natural width: minus c in int32 with VNNI; without, minus c's two parts (c = low + high,
  // each within int16) in the int16 pair, whose adds wrap on the way, the difference coming out
  // exact wherever it fits. Made once per row (`starting_at` reads it into every lane).
  static int32_t start_less(int32_t low, int32_t high) {
#if defined(SPECTRAL_VNNI)
    return -(low + high);
#else
    return static_cast<int32_t>(static_cast<uint32_t>(-high) << 16 |
                                static_cast<uint16_t>(-low));
#endif
  }
  static DotSum starting_at(const int32_t* start) {
    DotSum sum;
    sum.v = iv::words(*start);
    return sum;
  }
};
#endif

}  // namespace spectral_cpu
