// Small vector helpers shared by spectral's CPU kernels.
//
// `Vec` is one register of float32 lanes on the widest vector unit compiled in: AVX-512 (16
// lanes) or AVX2 with FMA (8 lanes). Where neither is there, SPECTRAL_VEC stays undefined and
// the kernels take their scalar loops (also built on purpose, with SPECTRAL_SCALAR, to test them).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(SPECTRAL_SCALAR)  // the scalar loops, built on purpose (their tests)
#elif defined(__AVX512F__)
#define SPECTRAL_VEC 512
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECTRAL_VEC 256
#endif

#if defined(SPECTRAL_VEC)
#include <immintrin.h>
#endif

namespace spectral_cpu {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#if SPECTRAL_VEC == 512
struct Vec {
  using R = __m512;
  static constexpr int kWidth = 16;
  // Accumulator registers per row of x in the small-M matmul (32 registers in all).
  static constexpr int accumulators(int rows) {
    return rows == 1 ? 6 : rows == 2 ? 4 : rows == 3 ? 3 : rows <= 8 ? 2 : 1;
  }
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float v) { return _mm512_set1_ps(v); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  // bfloat16 widened to float32: the 16 bits become the high half of each lane.
  static R load(const uint16_t* p) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static float reduce(R v) { return _mm512_reduce_add_ps(v); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static float reduce_max(R v) { return _mm512_reduce_max_ps(v); }
  // one bit a lane, lowest lane first: NaN lanes; lanes where a equals b (neither NaN)
  static unsigned nan_lanes(R v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
  static unsigned equal_lanes(R a, R b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
};
#elif SPECTRAL_VEC == 256
struct Vec {
  using R = __m256;
  static constexpr int kWidth = 8;
  // 16 registers in all, two of them kept for the loads.
  static constexpr int accumulators(int rows) {
    return rows <= 2 ? 4 : rows == 3 ? 3 : rows == 4 ? 2 : 1;
  }
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float v) { return _mm256_set1_ps(v); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const uint16_t* p) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  // the lanes combined pairwise by `op` (on halves, then quarters, then the last two)
  template <typename Op>
  static float fold(R v, Op op) {
    __m128 s = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = op(s, _mm_movehl_ps(s, s));
    s = op(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce(R v) { return fold(v, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); }); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static float reduce_max(R v) {
    return fold(v, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); });
  }
  static unsigned nan_lanes(R v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
  static unsigned equal_lanes(R a, R b) {
    return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ));
  }
};
#endif

#if defined(SPECTRAL_VEC)
inline Vec::R load(const c10::BFloat16* p) { return Vec::load(reinterpret_cast<const uint16_t*>(p)); }
inline Vec::R load(const float* p) { return Vec::load(p); }
#endif

// How far ahead of the block a matmul reads it asks for the weights it reads next. They stream
// from memory once a step, and the hardware prefetchers alone kept a core at ~60% of what a
// plain sum reads (bench/stream.py measures the builds; 0 turns the hint off). Far enough that
// the line is in before the tile gets there: cpu_kernels.prefetch_ahead() chooses it for the
// runtime's build (further on a CPU whose tiles run faster). The locality is
// __builtin_prefetch's: 0 non-temporal (what an AMD EPYC reads fastest), 3 into every level
// (an Intel Xeon: non-temporal lines skip its L2, and a matrix that fits there left it);
// cpu_kernels.prefetch_locality() chooses it for the runtime's build.
#ifndef SPECTRAL_PREFETCH_AHEAD
#define SPECTRAL_PREFETCH_AHEAD 1024
#endif
#ifndef SPECTRAL_PREFETCH_LOCALITY
#define SPECTRAL_PREFETCH_LOCALITY 0
#endif
constexpr int64_t kPrefetchAhead = SPECTRAL_PREFETCH_AHEAD;

// Asks for the `bytes` that lie kPrefetchAhead past `block` (a hint: it never faults, even
// past the end of the weights).
inline void prefetch_ahead(const void* block, int64_t bytes) {
  if constexpr (kPrefetchAhead > 0) {
    const char* p = static_cast<const char*>(block) + kPrefetchAhead;
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(p + off, 0, SPECTRAL_PREFETCH_LOCALITY);
  }
}

// The integer tiles of fewer rows of x than this read their weights without the hint: where a
// core's hardware prefetchers keep up with a tile of one row, the hint's loads only take their
// place. cpu_kernels.prefetch_min_rows() chooses it for the runtime's build (and says where it
// was measured).
#ifndef SPECTRAL_PREFETCH_MIN_ROWS
#define SPECTRAL_PREFETCH_MIN_ROWS 1
#endif

// prefetch_ahead for a tile of R rows of x.
template <int R>
inline void prefetch_for_rows(const void* block, int64_t bytes) {
  if constexpr (R >= SPECTRAL_PREFETCH_MIN_ROWS) prefetch_ahead(block, bytes);
}

// Which vector unit the kernels were compiled for: 512, 256, or 0 (scalar loops).
inline int vector_bits() {
#if defined(SPECTRAL_VEC)
  return SPECTRAL_VEC;
#else
  return 0;
#endif
}

}  // namespace spectral_cpu
