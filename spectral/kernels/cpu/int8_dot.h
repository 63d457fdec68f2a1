// The integer path's one product: 32 unsigned weight bytes times 32 signed activation bytes,
// each group of four products summed into the 32-bit lane that holds them. Two ways to keep
// the sums (quant_int8.cpp's tiles are written once against this interface):
//
//   AVX2:  `maddubs` adds the products in pairs into int16, the caller's int16 accumulator
//          takes several of those (each layout's bound keeps them exact), and `widen` adds
//          neighbouring int16 into int32 at the end;
//   VNNI:  `vpdpbusd` adds all four products straight into an int32 accumulator (AVX-512 VNNI
//          at 256 bits with AVX-512 VL, or AVX-VNNI), and `widen` has nothing left to do.
//
// The sums are the same integers either way. SPECTRAL_VNNI_EMULATED builds the VNNI form from
// AVX2 instructions (exact products in int16, no pair saturation), so the VNNI tiles' code runs
// and is tested on CPUs without the instruction. Free of torch: tests compile it alone under
// each instruction set's flags.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace spectral_cpu {

#if defined(__AVX2__) && (defined(SPECTRAL_VNNI_EMULATED) ||                              \
                          (defined(__AVX512VNNI__) && defined(__AVX512VL__)) ||             \
                          defined(__AVXVNNI__))
#define SPECTRAL_VNNI 1
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

#if defined(__AVX2__)
// acc + for each 32-bit lane the sum of its four products u8 * s8, exactly.
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) {
#if defined(SPECTRAL_VNNI_EMULATED)
  const __m256i low = _mm256_set1_epi16(0x00FF);
  const __m256i u_even = _mm256_and_si256(u, low), u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8);
  const __m256i s_odd = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even),
                                                _mm256_madd_epi16(u_odd, s_odd)));
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

// An accumulator of products in the lanes' natural width: int16 pairs on AVX2 (the caller
// keeps their sums within int16), int32 lanes with VNNI.
struct DotSum {
  __m256i v = _mm256_setzero_si256();
  // v + the products of u and s
  void add(__m256i u, __m256i s) {
#if defined(SPECTRAL_VNNI)
    v = dot4_add(v, u, s);
#else
    v = _mm256_add_epi16(v, _mm256_maddubs_epi16(u, s));
#endif
  }
  // the int32 sums of each lane's four products
  __m256i widen() const {
#if defined(SPECTRAL_VNNI)
    return v;
#else
    return _mm256_madd_epi16(v, _mm256_set1_epi16(1));
#endif
  }
  // widen() times each lane's scale, which `scale` holds in both int16 halves of the lane
  // (exact: the int16 sums are, and so are their products with it in int32).
  __m256i widen_scaled(__m256i scale) const {
#if defined(SPECTRAL_VNNI)
    return _mm256_mullo_epi32(v, _mm256_srai_epi32(scale, 16));
#else
    return _mm256_madd_epi16(v, scale);
#endif
  }
  // widen_minus(c) times each lane's scale (as widen_scaled).
  __m256i widen_minus_scaled(__m256i c, __m256i scale) const {
#if defined(SPECTRAL_VNNI)
    return _mm256_mullo_epi32(_mm256_sub_epi32(v, _mm256_madd_epi16(c, _mm256_set1_epi16(1))),
                              _mm256_srai_epi32(scale, 16));
#else
    return _mm256_madd_epi16(_mm256_sub_epi16(v, c), scale);
#endif
  }
  // widen() less each lane's two int16 of c. The int16 sums may have wrapped on the way (each
  // maddubs is exact, the adds wrap): the difference is exact wherever it fits int16.
  __m256i widen_minus(__m256i c) const {
#if defined(SPECTRAL_VNNI)
    return _mm256_sub_epi32(v, _mm256_madd_epi16(c, _mm256_set1_epi16(1)));
#else
    return _mm256_madd_epi16(_mm256_sub_epi16(v, c), _mm256_set1_epi16(1));
#endif
  }
};
#endif

}  // namespace spectral_cpu
