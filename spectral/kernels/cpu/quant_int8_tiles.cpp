// The integer path's tiles: each row of x quantized per block of 32 inputs to 8 bits
// (q = rint(x * 127 / amax), d = amax / 127, s = sum q), dotted with the weights' quants (the
// layouts of quant_int8_layout.h) in integers, and the int32 block sums combined in float32,
// block after block, each operation rounded once (this code is compiled without contraction
// into fused multiply-adds):
//
//   u = dw * isum  (+ mw * s, layouts with minimums;  Q8_0h: dw0 * isum0 + dw1 * isum1)
//   acc = acc + d * u
//
// Every row goes through the same operations whatever rows share its call, so a row's result
// never depends on the batch (tests/test_gguf_int8.py holds every build to a NumPy reference of
// this arithmetic).
//
// AVX2 (the AVX-512 builds too, 256 bits at a time): `maddubs` multiplies unsigned weight
// bytes by signed activation bytes and adds pairs into int16; signed weights (Q8_0, Q8_0h)
// go in as |w| against x carrying w's sign. int16 sums stay exact: a pair is at most
// 2 * 15 * 127 (Q4_1; eight added), 2 * 31 * 127 (Q8_0m; four), 2 * 32 * 127 (Q8_0h; four) or
// 2 * 128 * 127 (Q8_0; widened at once); `pack_q8_layout` refuses quants outside those ranges.
// Q6_K's quants go in unsigned (q + 32, pairs up to 2 * 63 * 127) and 32 x comes off after:
// the int16 sums wrap on the way, but those of q, at most 8 * 32 * 127, are exact.
// With VNNI the products go straight into int32 sums instead (int8_dot.h: the same integers).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "int8_dot.h"
#include "quant_int8_layout.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int kQ8Rows = 4;  // rows of x per tile

// x quantized: q [m, k] int8, d [m, k / 32] float32, s [m, k / 32] int32; for Q6_K's vector
// tiles also q6_bias [m, k / 16] (q6_biases; the other layouts leave it unread).
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t k;
  const int32_t* q6_bias = nullptr;
};

// One block of 32 inputs quantized (q = rint(x * 127 / amax), d = amax / 127, s = sum q). The
// vector form, 8 at a time, gives the scalar loop's numbers: the same amax (max_ps skips a NaN
// as std::max does, the accumulator its second operand), the same product rounded to the
// nearest even integer, the same sum.
#if defined(SPECTRAL_VEC)
inline void quantize_block(const float* xb, int8_t* q, float* d, int32_t* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax8);
  }
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax8, 1), _mm256_castps256_ps128(amax8));
  m4 = _mm_max_ps(_mm_movehl_ps(m4, m4), m4);
  m4 = _mm_max_ss(_mm_movehdup_ps(m4), m4);
  const float amax = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i qi[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 scaled = _mm256_mul_ps(v[i], inv);
    qi[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute puts them back.
  const __m256i w01 = _mm256_packs_epi32(qi[0], qi[1]), w23 = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *d = amax / 127.f;
  *s = _mm_cvtsi128_si32(s4);
}
#else
inline void quantize_block(const float* xb, int8_t* q, float* d, int32_t* s) {
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  *d = amax / 127.f;
  *s = sum;
}
#endif

// x [m, k] quantized per block of 32 into q [m, k], d and s [m, k / 32] (as Q8Rows holds them).
void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, float* d, int32_t* s) {
  const int64_t nb = k / kBlock;
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b)
        quantize_block(x + r * k + b * kBlock, q + r * k + b * kBlock, d + r * nb + b,
                       s + r * nb + b);
    }
  });
}

// What 32 times x adds per int16 lane to the sums of Q6_K's quants taken unsigned (q + 32; its
// vector tiles), per row and half of 16 inputs of q [m, k]: inputs 4g and 4g + 1 (g = 0..3) in
// the low 16 bits, 4g + 2 and 4g + 3 in the high 16; 32 * 8 * 127 at most, each fits.
void q6_biases(const int8_t* q, int64_t m, int64_t k, int32_t* bias) {
  for (int64_t i = 0; i < m * k / 16; ++i) {
    const int8_t* x = q + 16 * i;
    int32_t low = 0, high = 0;
    for (int g = 0; g < 4; ++g) {
      low += x[4 * g] + x[4 * g + 1];
      high += x[4 * g + 2] + x[4 * g + 3];
    }
    bias[i] = static_cast<int32_t>(static_cast<uint32_t>(32 * high) << 16 |
                                   static_cast<uint16_t>(32 * low));
  }
}

#if defined(SPECTRAL_VEC)
constexpr int kV = kNR / 8;  // 256-bit vectors of 8 columns x 4 inputs per group

// isum[r][v] (and, Q8_0h, isum[r][kV + v] for the last 16 inputs): the integer dot products of
// the R rows' quants of block b with the block's columns 8v..8v+7.
template <int Kind, int R>
inline void block_sums(const uint8_t* qw, const Q8Rows& x, int64_t row0, int64_t b,
                       __m256i (&isum)[R][2 * kV]) {
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q + (row0 + r) * x.k + b * kBlock;
  auto bcast = [](const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  };
  auto store = [&](int r, int half, int v, __m256i sum32) { isum[r][half * kV + v] = sum32; };
  // Each sum kept in a register as it is added to: left to itself the compiler computes a
  // group's products for every row first and spills them (a third of the instructions).
  auto settle = [](DotSum& sum) { asm("" : "+v"(sum.v)); };
  if constexpr (Kind == kQ4_1 || Kind == kQ4_K) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    DotSum acc[R][kV];
    for (int g = 0; g < 4; ++g) {
      __m256i lo[kV], hi[kV];
      for (int v = 0; v < kV; ++v) {
        const __m256i w =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + g * kNR * 4 + v * 32));
        lo[v] = _mm256_and_si256(w, mask);
        hi[v] = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xa = bcast(xq[r] + 4 * g), xb = bcast(xq[r] + 16 + 4 * g);
        for (int v = 0; v < kV; ++v) {
          acc[r][v].add(lo[v], xa);
          acc[r][v].add(hi[v], xb);
          settle(acc[r][v]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kV; ++v) store(r, 0, v, acc[r][v].widen());
  } else if constexpr (Kind == kQ5_0 || Kind == kQ5_1) {
    // Quants rebuilt from nibbles and fifth bits, eight columns at a time (the sums of two
    // accumulators a row fit the registers then): Q5_0's less 16 as |q| against x signed by
    // q (a group's two products at most 2 * 2 * 16 * 127, four groups fit int16), Q5_1's
    // unsigned with the first and last 16 inputs apart (each at most 4 * 2 * 31 * 127).
    const __m256i mask = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    for (int v = 0; v < kV; ++v) {
      const __m256i high =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + 16 * kNR + v * 32));
      DotSum first[R], last[R];
      for (int g = 0; g < 4; ++g) {
        const __m256i w =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + g * kNR * 4 + v * 32));
        __m256i lo = _mm256_or_si256(_mm256_and_si256(w, mask),
                                     _mm256_and_si256(_mm256_slli_epi16(high, 4 - g), fifth));
        __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), mask),
                                     _mm256_and_si256(_mm256_srli_epi16(high, g), fifth));
        if constexpr (Kind == kQ5_0) {
          const __m256i bias = _mm256_set1_epi8(16);
          lo = _mm256_sub_epi8(lo, bias);
          hi = _mm256_sub_epi8(hi, bias);
          const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);
          for (int r = 0; r < R; ++r) {
            const __m256i xa = bcast(xq[r] + 4 * g), xb = bcast(xq[r] + 16 + 4 * g);
            first[r].add(alo, _mm256_sign_epi8(xa, lo));
            first[r].add(ahi, _mm256_sign_epi8(xb, hi));
            settle(first[r]);
          }
        } else {
          for (int r = 0; r < R; ++r) {
            first[r].add(lo, bcast(xq[r] + 4 * g));
            settle(first[r]);
            last[r].add(hi, bcast(xq[r] + 16 + 4 * g));
            settle(last[r]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256i sum = first[r].widen();
        store(r, 0, v, Kind == kQ5_0 ? sum : _mm256_add_epi32(sum, last[r].widen()));
      }
    }
  } else if constexpr (Kind == kQ6_K) {
    // Quants u = q + 32 (0..63) rebuilt from nibbles and high bits and taken unsigned, the
    // first 16 inputs (low nibbles) and then the last 16 (high nibbles), and 32 x taken off at
    // the end (x.q6_bias): the sums of q itself (at most 8 * 32 * 127 a lane) fit int16, those
    // of u, a maddubs pair at most 2 * 63 * 127, wrap there on the way but come out exact.
    const __m256i mask = _mm256_set1_epi8(0x0F), high_bits = _mm256_set1_epi8(0x30);
    // Unrolled, so that each group's shifts are constants (the compiler leaves these loops be).
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      DotSum acc[R][kV];
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const int bit = (g / 2) * 4 + half * 2;  // where the group's high bits are, put at 4
        __m256i u[kV];
        for (int v = 0; v < kV; ++v) {
          const __m256i w =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + g * kNR * 4 + v * 32));
          const __m256i h = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(qw + 16 * kNR + (g % 2) * kNR * 4 + v * 32));
          const __m256i low = _mm256_and_si256(half ? _mm256_srli_epi16(w, 4) : w, mask);
          const __m256i high = bit < 4   ? _mm256_slli_epi16(h, 4 - bit)
                               : bit > 4 ? _mm256_srli_epi16(h, bit - 4)
                                         : h;
          u[v] = _mm256_or_si256(low, _mm256_and_si256(high, high_bits));
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xg = bcast(xq[r] + 16 * half + 4 * g);
          for (int v = 0; v < kV; ++v) {
            acc[r][v].add(u[v], xg);
            settle(acc[r][v]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256i bias = _mm256_set1_epi32(x.q6_bias[(row0 + r) * x.k / 16 + 2 * b + half]);
        for (int v = 0; v < kV; ++v) store(r, half, v, acc[r][v].widen_minus(bias));
      }
    }
  } else if constexpr (Kind == kQ8_0) {
    // A group's pair sums reach 2 * 128 * 127: widened at once (dot4_add) instead of summed.
    DotSum acc[R][kV];  // int32 sums here, whatever the build
    for (int g = 0; g < 8; ++g) {
      __m256i w[kV], aw[kV];
      for (int v = 0; v < kV; ++v) {
        w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + g * kNR * 4 + v * 32));
        aw[v] = _mm256_abs_epi8(w[v]);
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xg = bcast(xq[r] + 4 * g);
        for (int v = 0; v < kV; ++v) {
          acc[r][v].v = dot4_add(acc[r][v].v, aw[v], _mm256_sign_epi8(xg, w[v]));
          settle(acc[r][v]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kV; ++v) store(r, 0, v, acc[r][v].v);
  } else {
    // Q8_0m (unsigned quants) and Q8_0h (signed): groups 0..3 and 4..7 in int16 apart, the two
    // halves of the block (Q8_0h keeps them apart: each has its own d).
    for (int half = 0; half < 2; ++half) {
      DotSum acc[R][kV];
      for (int g = 4 * half; g < 4 * half + 4; ++g) {
        __m256i w[kV], aw[kV];
        for (int v = 0; v < kV; ++v) {
          w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + g * kNR * 4 + v * 32));
          aw[v] = Kind == kQ8_0h ? _mm256_abs_epi8(w[v]) : w[v];
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xg = bcast(xq[r] + 4 * g);
          for (int v = 0; v < kV; ++v) {
            acc[r][v].add(aw[v], Kind == kQ8_0h ? _mm256_sign_epi8(xg, w[v]) : xg);
            settle(acc[r][v]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kV; ++v) store(r, half, v, acc[r][v].widen());
    }
    if constexpr (Kind == kQ8_0m) {
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kV; ++v) isum[r][v] = _mm256_add_epi32(isum[r][v], isum[r][kV + v]);
    }
  }
}

// out[R][kNR]: rows row0.. of x over one panel, block sums combined block after block.
template <int Kind, int R>
void q8_tile(const Q8Rows& x, int64_t row0, const uint8_t* panel, float* out) {
  constexpr int Q = quant_kind(Kind);  // how the block's quants are kept
  const int64_t nb = x.k / kBlock;
  __m256 acc[R][kV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = _mm256_setzero_ps();
  const uint8_t* blocks = panel + q8_header_bytes(Kind, nb);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = blocks + b * q8_block_bytes(Kind);
    prefetch_ahead(blk, q8_block_bytes(Kind));
    __m256 dw[kV], mw[kV];  // the block's d and m (Q8_0h: the last 16 inputs' d) per column
    for (int v = 0; v < kV; ++v) {
      if constexpr (Kind == kQ4_K) {
        const float* sb = reinterpret_cast<const float*>(panel + (b / 8) * 8 * kNR);
        auto widen = [](const uint8_t* p) {
          return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
        };
        dw[v] = _mm256_mul_ps(_mm256_loadu_ps(sb + 8 * v), widen(blk + 8 * v));
        mw[v] = _mm256_mul_ps(_mm256_loadu_ps(sb + kNR + 8 * v), widen(blk + kNR + 8 * v));
      } else if constexpr (Kind == kQ6_K) {
        const float* sb = reinterpret_cast<const float*>(panel + (b / 8) * 4 * kNR);
        auto widen = [](const uint8_t* p) {
          return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
        };
        dw[v] = _mm256_mul_ps(_mm256_loadu_ps(sb + 8 * v), widen(blk + 8 * v));
        mw[v] = _mm256_mul_ps(_mm256_loadu_ps(sb + 8 * v), widen(blk + kNR + 8 * v));
      } else if constexpr (half_scales(Kind)) {
        const auto* h = reinterpret_cast<const __m128i*>(blk);
        dw[v] = _mm256_cvtph_ps(_mm_loadu_si128(h + v));
        if constexpr (Q != kQ8_0 && Q != kQ5_0) mw[v] = _mm256_cvtph_ps(_mm_loadu_si128(h + kV + v));
      } else {
        const float* d = reinterpret_cast<const float*>(blk);
        dw[v] = _mm256_loadu_ps(d + 8 * v);
        if constexpr (Kind != kQ8_0) mw[v] = _mm256_loadu_ps(d + kNR + 8 * v);
      }
    }
    __m256i isum[R][2 * kV];
    block_sums<Q, R>(blk + q8_quants_offset(Kind), x, row0, b, isum);
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(x.d[(row0 + r) * nb + b]);
      const __m256 sx = _mm256_set1_ps(static_cast<float>(x.s[(row0 + r) * nb + b]));
      for (int v = 0; v < kV; ++v) {
        __m256 u = _mm256_mul_ps(dw[v], _mm256_cvtepi32_ps(isum[r][v]));
        if constexpr (Q == kQ4_1 || Q == kQ4_K || Q == kQ8_0m || Q == kQ5_1) {
          u = _mm256_add_ps(u, _mm256_mul_ps(mw[v], sx));
        } else if constexpr (Q == kQ8_0h || Q == kQ6_K) {
          u = _mm256_add_ps(u, _mm256_mul_ps(mw[v], _mm256_cvtepi32_ps(isum[r][kV + v])));
        }
        acc[r][v] = _mm256_add_ps(acc[r][v], _mm256_mul_ps(dx, u));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) _mm256_storeu_ps(out + r * kNR + 8 * v, acc[r][v]);
}
#else
// isum[r][c] (and, Q8_0h, isum[r][kNR + c] for the last 16 inputs): the integer dot products of
// the R rows' quants of block b with the block's columns.
template <int Kind, int R>
inline void block_sums(const uint8_t* qw, const Q8Rows& x, int64_t row0, int64_t b,
                       int32_t (&isum)[R][2 * kNR]) {
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q + (row0 + r) * x.k + b * kBlock;
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kNR; ++c) {
      int32_t first = 0, last = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        int32_t w;
        if constexpr (Kind == kQ4_1 || Kind == kQ4_K) {
          const uint8_t byte = qw[q8_offset(j % 16, c)];
          w = j < 16 ? byte & 0x0F : byte >> 4;
        } else if constexpr (Kind == kQ6_K) {
          const uint8_t byte = qw[q8_offset(j % 16, c)];
          const int32_t high = (qw[16 * kNR + q6_high_offset(j, c)] >> q6_high_shift(j)) & 3;
          w = ((j < 16 ? byte & 0x0F : byte >> 4) | (high << 4)) - 32;
        } else if constexpr (Kind == kQ5_0 || Kind == kQ5_1) {
          const uint8_t byte = qw[q8_offset(j % 16, c)];
          const int32_t high = (qw[16 * kNR + q5_high_offset(j, c)] >> q5_high_shift(j)) & 1;
          w = ((j < 16 ? byte & 0x0F : byte >> 4) | (high << 4)) - (Kind == kQ5_0 ? 16 : 0);
        } else if constexpr (Kind == kQ8_0m) {
          w = qw[q8_offset(j, c)];
        } else {
          w = static_cast<int8_t>(qw[q8_offset(j, c)]);
        }
        (j < 16 ? first : last) += w * xq[r][j];
      }
      if constexpr (Kind == kQ8_0h || Kind == kQ6_K) {
        isum[r][c] = first;
        isum[r][kNR + c] = last;
      } else {
        isum[r][c] = first + last;
      }
    }
  }
}

// out[R][kNR]: rows row0.. of x over one panel, block sums combined block after block.
template <int Kind, int R>
void q8_tile(const Q8Rows& x, int64_t row0, const uint8_t* panel, float* out) {
  constexpr int Q = quant_kind(Kind);  // how the block's quants are kept
  const int64_t nb = x.k / kBlock;
  alignas(64) float acc[R][kNR] = {};
  alignas(64) int32_t isum[R][2 * kNR];
  const uint8_t* blocks = panel + q8_header_bytes(Kind, nb);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = blocks + b * q8_block_bytes(Kind);
    float dw[kNR], mw[kNR];
    for (int64_t c = 0; c < kNR; ++c) {
      if constexpr (Kind == kQ4_K) {
        const float* sb = reinterpret_cast<const float*>(panel + (b / 8) * 8 * kNR);
        dw[c] = sb[c] * static_cast<float>(blk[c]);
        mw[c] = sb[kNR + c] * static_cast<float>(blk[kNR + c]);
      } else if constexpr (Kind == kQ6_K) {
        const float* sb = reinterpret_cast<const float*>(panel + (b / 8) * 4 * kNR);
        dw[c] = sb[c] * static_cast<float>(static_cast<int8_t>(blk[c]));
        mw[c] = sb[c] * static_cast<float>(static_cast<int8_t>(blk[kNR + c]));
      } else if constexpr (half_scales(Kind)) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(blk);
        dw[c] = static_cast<float>(c10::Half(h[c], c10::Half::from_bits()));
        mw[c] = Q == kQ8_0 || Q == kQ5_0
                    ? 0.f
                    : static_cast<float>(c10::Half(h[kNR + c], c10::Half::from_bits()));
      } else {
        const float* d = reinterpret_cast<const float*>(blk);
        dw[c] = d[c];
        mw[c] = Kind == kQ8_0 ? 0.f : d[kNR + c];
      }
    }
    block_sums<Q, R>(blk + q8_quants_offset(Kind), x, row0, b, isum);
    for (int r = 0; r < R; ++r) {
      const float dx = x.d[(row0 + r) * nb + b];
      const float sx = static_cast<float>(x.s[(row0 + r) * nb + b]);
      for (int64_t c = 0; c < kNR; ++c) {
        float u = dw[c] * static_cast<float>(isum[r][c]);
        if constexpr (Q == kQ4_1 || Q == kQ4_K || Q == kQ8_0m || Q == kQ5_1) u = u + mw[c] * sx;
        if constexpr (Q == kQ8_0h || Q == kQ6_K)
          u = u + mw[c] * static_cast<float>(isum[r][kNR + c]);
        acc[r][c] = acc[r][c] + dx * u;
      }
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}
#endif

template <int Kind, int R = kQ8Rows>
void q8_tile_rows(int rows, const Q8Rows& x, int64_t row0, const uint8_t* panel, float* out) {
  if constexpr (R > 1) {
    if (rows < R) return q8_tile_rows<Kind, R - 1>(rows, x, row0, panel, out);
  }
  q8_tile<Kind, R>(x, row0, panel, out);
}

template <int Kind, typename O>
void run_q8(const Q8Rows& x, int64_t m, const uint8_t* packed, int64_t n, O* out) {
  const int64_t panels = (n + kNR - 1) / kNR;
  const int64_t panel_bytes = q8_panel_bytes(Kind, x.k / kBlock);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float buf[kQ8Rows * kNR];
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t r0 = 0; r0 < m; r0 += kQ8Rows) {
        const int rows = static_cast<int>(std::min<int64_t>(kQ8Rows, m - r0));
        q8_tile_rows<Kind>(rows, x, r0, packed + p * panel_bytes, buf);
        store_tile(buf, rows, r0, n, p * kNR, out);
      }
    }
  });
}

}  // namespace

// x [m, k] float32 or bfloat16 -> (q int8 [m, k], d float32 [m, k / 32], s int32 [m, k / 32]).
std::vector<torch::Tensor> quantize_q8(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "x has ", k, " columns, not a multiple of 32");
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor q = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  torch::Tensor d = torch::empty({m, k / kBlock}, x.options().dtype(torch::kFloat32));
  torch::Tensor s = torch::empty({m, k / kBlock}, x.options().dtype(torch::kInt32));
  quantize_rows(xf.data_ptr<float>(), m, k, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                s.data_ptr<int32_t>());
  return {q, d, s};
}

#pragma GCC pop_options
