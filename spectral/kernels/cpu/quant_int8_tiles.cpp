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
// AVX2 (AVX-512 BW likewise, 512 bits at a time): `maddubs` multiplies unsigned weight
// bytes by signed activation bytes and adds pairs into int16; signed weights (Q8_0, Q8_0h)
// go in as |w| against x carrying w's sign. int16 sums stay exact: a pair is at most
// 2 * 15 * 127 (Q4_1; eight added), 2 * 31 * 127 (Q8_0m; four), 2 * 32 * 127 (Q8_0h; four) or
// 2 * 128 * 127 (Q8_0; widened at once); `pack_q8_layout` refuses quants outside those ranges.
// Q6_K's quants go in unsigned (q + 32, pairs up to 2 * 63 * 127) and 32 x comes off after:
// the int16 sums wrap on the way, but those of q, at most 8 * 32 * 127, are exact.
// With VNNI the products go straight into int32 sums instead (int8_dot.h: the same integers),
// and Q8_0's quants go in unsigned, q + 128, with 128 times x's block sum taken off after.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "int8_dot.h"
#include "quant_int8_layout.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

// Rows of x per tile: two accumulators a row, within the registers (16 at 256 bits, 32 at 512).
#if defined(SPECTRAL_INT8_BITS) && SPECTRAL_INT8_BITS == 512
constexpr int kQ8Rows = 8;
#else
constexpr int kQ8Rows = 4;
#endif

// x quantized: q [m, k] int8, d [m, k / 32] float32, s [m, k / 32] int32; for the K-quant tiles
// per superblock, with each block's shift [m, k / 32] (quantize_rows); for Q6_K's vector tiles
// also q6_start [m, k / 16] (q6_starts), for Q4_K's s_pairs [m, k / 64] (s_pairs; the other
// layouts leave them unread).
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t k;
  const int8_t* shift = nullptr;
  const int32_t* q6_start = nullptr;
  const int32_t* s_pairs = nullptr;
};

// A superblock's blocks are quantized on its step divided by up to 2^kMaxFiner (quantize_rows).
constexpr int kMaxFiner = 3;

// One block of 32 inputs quantized (q = rint(x * 127 / amax), d = amax / 127, s = sum q). The
// vector form, 8 at a time, gives the scalar loop's numbers: the same amax (max_ps skips a NaN
// as std::max does, the accumulator its second operand), the same product rounded to the
// nearest even integer, the same sum.
#if defined(SPECTRAL_VEC)
inline float block_amax(const float* xb) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i)
    amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)), amax8);
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax8, 1), _mm256_castps256_ps128(amax8));
  m4 = _mm_max_ps(_mm_movehl_ps(m4, m4), m4);
  m4 = _mm_max_ss(_mm_movehdup_ps(m4), m4);
  return _mm_cvtss_f32(m4);
}

// q = rint(xb * inv) and s = sum q of one block of 32.
inline void quantize_block(const float* xb, float inv_scalar, int8_t* q, int32_t* s) {
  const __m256 inv = _mm256_set1_ps(inv_scalar);
  __m256i qi[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), inv);
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
  *s = _mm_cvtsi128_si32(s4);
}
#else
inline float block_amax(const float* xb) {
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
  return amax;
}

// q = rint(xb * inv) and s = sum q of one block of 32.
inline void quantize_block(const float* xb, float inv, int8_t* q, int32_t* s) {
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  *s = sum;
}
#endif

// The largest e <= 3 with amax * 2^e <= top (a block of a superblock whose amax is `top` then
// quantized on a step 2^-e times the superblock's).
inline int finer(float amax, float top) {
  int e = kMaxFiner;
  while (e > 0 && !(amax * static_cast<float>(1 << e) <= top)) --e;
  return e;
}

// x [m, k] quantized per block of 32 into q [m, k], d and s [m, k / 32] (as Q8Rows holds them).
// With `shift` [m, k / 32] (the K-quant tiles' input), per superblock of 256 inputs: d is the
// superblock's (amax / 127 of all 256, in each of its blocks), and each block is quantized on
// that step divided by 2^e, e = 3 - shift, the most within its own amax (q of a block with small
// values as fine as on its own amax, up to 8 times the superblock's step).
void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, float* d, int32_t* s,
                   int8_t* shift) {
  const int64_t nb = k / kBlock, span = shift ? 8 : 1;
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    float amax[8];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b0 = 0; b0 < nb; b0 += span) {
        float top = 0.f;
        for (int64_t j = 0; j < span; ++j) {
          amax[j] = block_amax(x + r * k + (b0 + j) * kBlock);
          top = std::max(top, amax[j]);
        }
        const float inv = top > 0.f ? 127.f / top : 0.f;
        for (int64_t j = 0, b = b0; j < span; ++j, ++b) {
          const int e = shift ? finer(amax[j], top) : 0;
          if (shift) shift[r * nb + b] = static_cast<int8_t>(kMaxFiner - e);
          quantize_block(x + r * k + b * kBlock, inv * static_cast<float>(1 << e),
                         q + r * k + b * kBlock, s + r * nb + b);
          d[r * nb + b] = top / 127.f;
        }
      }
    }
  });
}

#if defined(SPECTRAL_VEC)
// Where the sums of Q6_K's quants taken unsigned (q + 32; its vector tiles) start, per row and
// half of 16 inputs of q [m, k]: at minus 32 x, so that they come out as the sums of q
// (DotSum::start_less; without VNNI, inputs 4g and 4g + 1 (g = 0..3) make the low int16 of
// the pair, 4g + 2 and 4g + 3 the high: 32 * 8 * 127 at most, each fits).
void q6_starts(const int8_t* q, int64_t m, int64_t k, int32_t* start) {
  for (int64_t i = 0; i < m * k / 16; ++i) {
    const int8_t* x = q + 16 * i;
    int32_t low = 0, high = 0;
    for (int g = 0; g < 4; ++g) {
      low += x[4 * g] + x[4 * g + 1];
      high += x[4 * g + 2] + x[4 * g + 3];
    }
    start[i] = DotSum::start_less(32 * low, 32 * high);
  }
}
#endif

// s [m, k / 32] times 2^shift as int16 pairs: block 2i's in the low 16 bits of s_pairs[i],
// 2i + 1's in the high (each at most 32 * 127 * 8: it fits).
void s_pairs(const int32_t* s, const int8_t* shift, int64_t count, int32_t* pairs) {
  for (int64_t i = 0; i < count / 2; ++i)
    pairs[i] = static_cast<int32_t>(
        static_cast<uint32_t>(s[2 * i + 1] * (1 << shift[2 * i + 1])) << 16 |
        static_cast<uint16_t>(s[2 * i] * (1 << shift[2 * i])));
}

#if defined(SPECTRAL_VEC)
constexpr int kV = kNR / kIntLanes;  // vectors of kIntLanes columns x 4 inputs per group
constexpr int kVecBytes = sizeof(IVec);
using iv::bcast4;

// Each sum kept in a register as it is added to: left to itself the compiler computes a group's
// products for every row first and spills them (a third of the instructions).
inline void settle(DotSum& sum) { asm("" : "+v"(sum.v)); }

// The group's vector v of a block's regrouped quants.
inline IVec group_vec(const uint8_t* qw, int g, int v) {
  return iv::load(qw + g * kNR * 4 + v * kVecBytes);
}

// acc[r][v]: the products of rows xq[r]'s 32 inputs with a block of nibbles (Q4_1, Q4_K: low
// nibbles inputs 0..15, high 16..31) of columns kIntLanes v.., in the sums' natural width.
template <int R>
inline void nibble_sums(const uint8_t* qw, const int8_t* const* xq, DotSum (&acc)[R][kV]) {
  const IVec mask = iv::bytes(0x0F);
  for (int g = 0; g < 4; ++g) {
    IVec lo[kV], hi[kV];
    for (int v = 0; v < kV; ++v) {
      const IVec w = group_vec(qw, g, v);
      lo[v] = iv::and_(w, mask);
      hi[v] = iv::and_(iv::srl16(w, 4), mask);
    }
    for (int r = 0; r < R; ++r) {
      const IVec xa = bcast4(xq[r] + 4 * g), xb = bcast4(xq[r] + 16 + 4 * g);
      for (int v = 0; v < kV; ++v) {
        acc[r][v].add(lo[v], xa);
        acc[r][v].add(hi[v], xb);
        settle(acc[r][v]);
      }
    }
  }
}

// isum[r][v] (and, Q8_0h, isum[r][kV + v] for the last 16 inputs): the integer dot products of
// the R rows' quants of block b with the block's columns kIntLanes v...
template <int Kind, int R>
inline void block_sums(const uint8_t* qw, const Q8Rows& x, int64_t row0, int64_t b,
                       IVec (&isum)[R][2 * kV]) {
  const int8_t* xq[R];
  for (int r = 0; r < R; ++r) xq[r] = x.q + (row0 + r) * x.k + b * kBlock;
  auto store = [&](int r, int half, int v, IVec sum32) { isum[r][half * kV + v] = sum32; };
  if constexpr (Kind == kQ4_1) {
    DotSum acc[R][kV];
    nibble_sums<R>(qw, xq, acc);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kV; ++v) store(r, 0, v, acc[r][v].widen());
  } else if constexpr (Kind == kQ5_0 || Kind == kQ5_1) {
    // Quants rebuilt from nibbles and fifth bits, one vector of columns at a time (the sums of
    // two accumulators a row fit the registers then): Q5_0's less 16 as |q| against x signed
    // by q (a group's two products at most 2 * 2 * 16 * 127, four groups fit int16), Q5_1's
    // unsigned with the first and last 16 inputs apart (each at most 4 * 2 * 31 * 127).
    const IVec mask = iv::bytes(0x0F), fifth = iv::bytes(0x10);
    for (int v = 0; v < kV; ++v) {
      const IVec high = iv::load(qw + 16 * kNR + v * kVecBytes);
      DotSum first[R], last[R];
      for (int g = 0; g < 4; ++g) {
        const IVec w = group_vec(qw, g, v);
        IVec lo = iv::or_(iv::and_(w, mask), iv::and_(iv::sll16(high, 4 - g), fifth));
        IVec hi = iv::or_(iv::and_(iv::srl16(w, 4), mask), iv::and_(iv::srl16(high, g), fifth));
        if constexpr (Kind == kQ5_0) {
          const IVec bias = iv::bytes(16);
          lo = iv::sub8(lo, bias);
          hi = iv::sub8(hi, bias);
          const IVec alo = iv::abs8(lo), ahi = iv::abs8(hi);
          for (int r = 0; r < R; ++r) {
            const IVec xa = bcast4(xq[r] + 4 * g), xb = bcast4(xq[r] + 16 + 4 * g);
            first[r].add(alo, iv::sign8(xa, lo));
            first[r].add(ahi, iv::sign8(xb, hi));
            settle(first[r]);
          }
        } else {
          for (int r = 0; r < R; ++r) {
            first[r].add(lo, bcast4(xq[r] + 4 * g));
            settle(first[r]);
            last[r].add(hi, bcast4(xq[r] + 16 + 4 * g));
            settle(last[r]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const IVec sum = first[r].widen();
        store(r, 0, v, Kind == kQ5_0 ? sum : iv::add32(sum, last[r].widen()));
      }
    }
  } else if constexpr (Kind == kQ8_0) {
    // A group's pair sums reach 2 * 128 * 127: widened at once (dot4_add) instead of summed.
    // With VNNI the quants go in unsigned, q + 128 (their top bit flipped), against x itself,
    // and 128 s comes off at the end; without, |q| against x signed by q.
    DotSum acc[R][kV];  // int32 sums here, whatever the build
    for (int g = 0; g < 8; ++g) {
      IVec w[kV], aw[kV];
      for (int v = 0; v < kV; ++v) {
        w[v] = group_vec(qw, g, v);
        aw[v] = kVnni ? iv::xor_(w[v], iv::bytes(-128)) : iv::abs8(w[v]);
      }
      for (int r = 0; r < R; ++r) {
        const IVec xg = bcast4(xq[r] + 4 * g);
        for (int v = 0; v < kV; ++v) {
          acc[r][v].v = dot4_add(acc[r][v].v, aw[v], kVnni ? xg : iv::sign8(xg, w[v]));
          settle(acc[r][v]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      IVec bias = iv::zero();  // with VNNI, what the quants' flipped top bits added: 128 s
      if constexpr (kVnni != 0) bias = iv::words(128 * x.s[(row0 + r) * (x.k / kBlock) + b]);
      for (int v = 0; v < kV; ++v) store(r, 0, v, iv::sub32(acc[r][v].v, bias));
    }
  } else {
    // Q8_0m (unsigned quants) and Q8_0h (signed): groups 0..3 and 4..7 in int16 apart, the two
    // halves of the block (Q8_0h keeps them apart: each has its own d).
    for (int half = 0; half < 2; ++half) {
      DotSum acc[R][kV];
      for (int g = 4 * half; g < 4 * half + 4; ++g) {
        IVec w[kV], aw[kV];
        for (int v = 0; v < kV; ++v) {
          w[v] = group_vec(qw, g, v);
          aw[v] = Kind == kQ8_0h ? iv::abs8(w[v]) : w[v];
        }
        for (int r = 0; r < R; ++r) {
          const IVec xg = bcast4(xq[r] + 4 * g);
          for (int v = 0; v < kV; ++v) {
            acc[r][v].add(aw[v], Kind == kQ8_0h ? iv::sign8(xg, w[v]) : xg);
            settle(acc[r][v]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kV; ++v) store(r, half, v, acc[r][v].widen());
    }
    if constexpr (Kind == kQ8_0m) {
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kV; ++v) isum[r][v] = iv::add32(isum[r][v], isum[r][kV + v]);
    }
  }
}

// acc[R0..R0 + G] + block b's products with those rows of x, its sums combined in float32. At 8
// rows Q4_1's tile takes two groups of 4 (8 rows' sums beside their float sums spilled: one
// group of 8 read 0.98-0.99x two of 4 on an AMD EPYC, in cache; Q8_0's tile read 0.90x so).
template <int Kind, int R0, int G, int R>
inline void block_rows(const uint8_t* blk, const Q8Rows& x, int64_t row0, int64_t b,
                       const FVec (&dw)[kV], const FVec (&mw)[kV], FVec (&acc)[R][kV]) {
  constexpr int Q = quant_kind(Kind);
  const int64_t nb = x.k / kBlock;
  IVec isum[G][2 * kV];
  block_sums<Q, G>(blk + q8_quants_offset(Kind), x, row0 + R0, b, isum);
  for (int r = 0; r < G; ++r) {
    const FVec dx = iv::fset1(x.d[(row0 + R0 + r) * nb + b]);
    const FVec sx = iv::fset1(static_cast<float>(x.s[(row0 + R0 + r) * nb + b]));
    for (int v = 0; v < kV; ++v) {
      FVec u = iv::fmul(dw[v], iv::to_float(isum[r][v]));
      if constexpr (Q == kQ4_1 || Q == kQ8_0m || Q == kQ5_1) {
        u = iv::fadd(u, iv::fmul(mw[v], sx));
      } else if constexpr (Q == kQ8_0h) {
        u = iv::fadd(u, iv::fmul(mw[v], iv::to_float(isum[r][kV + v])));
      }
      acc[R0 + r][v] = iv::fadd(acc[R0 + r][v], iv::fmul(dx, u));
    }
  }
}

// out[R][kNR]: rows row0.. of x over one panel, block sums combined block after block.
template <int Kind, int R>
void q8_tile(const Q8Rows& x, int64_t row0, const uint8_t* panel, float* out) {
  constexpr int Q = quant_kind(Kind);  // how the block's quants are kept
  const int64_t nb = x.k / kBlock;
  FVec acc[R][kV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = iv::fzero();
  const uint8_t* blocks = panel + q8_header_bytes(Kind, nb);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = blocks + b * q8_block_bytes(Kind);
    prefetch_for_rows<R>(blk, q8_block_bytes(Kind));
    FVec dw[kV], mw[kV];  // the block's d and m (Q8_0h: the last 16 inputs' d) per column
    for (int v = 0; v < kV; ++v) {
      if constexpr (half_scales(Kind)) {
        const auto* h = reinterpret_cast<const uint16_t*>(blk);
        dw[v] = iv::half_lanes(h + kIntLanes * v);
        if constexpr (Q != kQ8_0 && Q != kQ5_0) mw[v] = iv::half_lanes(h + kNR + kIntLanes * v);
      } else {
        const float* d = reinterpret_cast<const float*>(blk);
        dw[v] = iv::fload(d + kIntLanes * v);
        if constexpr (Kind != kQ8_0) mw[v] = iv::fload(d + kNR + kIntLanes * v);
      }
    }
    if constexpr (R == 8 && Q == kQ4_1) {  // two groups of rows (block_rows)
      block_rows<Kind, 0, 4, R>(blk, x, row0, b, dw, mw, acc);
      block_rows<Kind, 4, 4, R>(blk, x, row0, b, dw, mw, acc);
    } else {
      block_rows<Kind, 0, R, R>(blk, x, row0, b, dw, mw, acc);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) iv::fstore(out + r * kNR + kIntLanes * v, acc[r][v]);
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
      if constexpr (half_scales(Kind)) {
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
        if constexpr (Q == kQ4_1 || Q == kQ8_0m || Q == kQ5_1) u = u + mw[c] * sx;
        if constexpr (Q == kQ8_0h)
          u = u + mw[c] * static_cast<float>(isum[r][kNR + c]);
        acc[r][c] = acc[r][c] + dx * u;
      }
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}
#endif

}  // namespace

#pragma GCC pop_options
