// The register tile both matmuls share: an R x kNR tile of the output for R rows of x over one
// panel of kNR output columns whose weights lie side by side per input (panel[k][kNR]). Per
// input it loads the panel's kNR weights once (two vectors) and multiplies them by R broadcast
// values of x; sums are float32 in order of k.
#pragma once

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace spectral_cpu {

#if defined(SPECTRAL_VEC)
constexpr int64_t kLanes = Vec::kWidth;
// Output rows per tile: 2 accumulators each, plus two weight vectors and one broadcast, within
// the 16 (AVX2) or 32 (AVX-512) vector registers.
constexpr int kMR = Vec::kWidth == 16 ? 12 : 6;
#else
constexpr int64_t kLanes = 8;
constexpr int kMR = 4;
#endif
constexpr int64_t kNR = 2 * kLanes;

inline void put(float* out, int64_t i, float v) { out[i] = v; }
inline void put(c10::BFloat16* out, int64_t i, float v) { out[i] = static_cast<c10::BFloat16>(v); }

inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_float(v); }

// Sets of accumulators a tile of R rows spreads consecutive inputs over (summed at the end):
// with few rows, one set's multiply-adds would wait on one another.
template <int R>
constexpr int accumulator_sets() {
  return R <= 3 ? 2 : 1;
}

#if defined(SPECTRAL_VEC)
// lo[r] | hi[r] += x[r][i] * (w0 | w1) for the R rows of a tile (row stride k of x).
template <int R>
inline void accumulate(Vec::R* lo, Vec::R* hi, const float* x, int64_t k, int64_t i, Vec::R w0,
                       Vec::R w1) {
  for (int r = 0; r < R; ++r) {
    const Vec::R xb = Vec::set1(x[r * k + i]);
    lo[r] = Vec::fma(xb, w0, lo[r]);
    hi[r] = Vec::fma(xb, w1, hi[r]);
  }
}

// The S sets of a tile's sums added up and stored into out[R][kNR].
template <int R, int S>
inline void store_sums(Vec::R (&lo)[S][R], Vec::R (&hi)[S][R], float* out) {
  for (int r = 0; r < R; ++r) {
    for (int s = 1; s < S; ++s) {
      lo[0][r] = Vec::add(lo[0][r], lo[s][r]);
      hi[0][r] = Vec::add(hi[0][r], hi[s][r]);
    }
    Vec::store(out + r * kNR, lo[0][r]);
    Vec::store(out + r * kNR + kLanes, hi[0][r]);
  }
}
#endif

// The R x kNR tile of out for rows x[0..R) (row stride k) over one panel, into out[R][kNR].
template <int R, typename W>
void tile(const float* x, int64_t k, const W* panel, float* out) {
#if defined(SPECTRAL_VEC)
  constexpr int kSets = accumulator_sets<R>();
  Vec::R lo[kSets][R], hi[kSets][R];
  for (int s = 0; s < kSets; ++s)
    for (int r = 0; r < R; ++r) lo[s][r] = hi[s][r] = Vec::zero();
  auto step = [&](int64_t i, int s) {
    prefetch_ahead(panel + i * kNR, kNR * sizeof(W));
    accumulate<R>(lo[s], hi[s], x, k, i, Vec::load(panel + i * kNR),
                  Vec::load(panel + i * kNR + kLanes));
  };
  int64_t i = 0;
  for (; i + kSets <= k; i += kSets)
    for (int s = 0; s < kSets; ++s) step(i + s, s);
  for (; i < k; ++i) step(i, 0);
  store_sums<R, kSets>(lo, hi, out);
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kNR; ++c) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc += x[r * k + i] * widen(panel[i * kNR + c]);
      out[r * kNR + c] = acc;
    }
  }
#endif
}

template <typename W, int R = kMR>
void tile_rows(int rows, const float* x, int64_t k, const W* panel, float* out) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<W, R - 1>(rows, x, k, panel, out);
  }
  tile<R, W>(x, k, panel, out);
}

// Rows [q0, q0 + rows) of a tile buffer (row stride kNR) into columns [j0, j0 + kNR) of out
// (row stride ld), the ones of the n that exist.
template <typename O>
inline void store_tile(const float* buf, int rows, int64_t q0, int64_t n, int64_t j0, O* out,
                       int64_t ld) {
  const int64_t cols = std::min(kNR, n - j0);
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) put(out, (q0 + r) * ld + j0 + c, buf[r * kNR + c]);
}

// Every block of rows of x over one panel; columns [j0, j0 + kNR) of out (row stride n).
template <typename W, typename O>
void panel_rows(const float* x, int64_t m, int64_t k, const W* panel, int64_t n, int64_t j0,
                O* out) {
  alignas(64) float buf[kMR * kNR];
  for (int64_t q0 = 0; q0 < m; q0 += kMR) {
    const int rows = static_cast<int>(std::min<int64_t>(kMR, m - q0));
    tile_rows<W>(rows, x + q0 * k, k, panel, buf);
    store_tile(buf, rows, q0, n, j0, out, n);
  }
}

}  // namespace spectral_cpu
