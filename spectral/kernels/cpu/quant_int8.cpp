// The integer path over GGUF blocks (`--quantization gguf-int8`): each row of x quantized per
// block of 32 inputs to 8 bits (q = rint(x * 127 / amax), d = amax / 127, s = sum q), dotted
// with the weights' quants in integers, and the int32 block sums combined in float32, block
// after block, each operation rounded once (this code is compiled without contraction into
// fused multiply-adds):
//
//   u = dw * isum  (+ mw * s, layouts with minimums;  Q8_0h: dw0 * isum0 + dw1 * isum1)
//   acc = acc + d * u
//
// Every row goes through the same operations whatever rows share its call, so a row's result
// never depends on the batch (tests/test_gguf_int8.py holds every build to a NumPy reference of
// this arithmetic). The weights are the layouts of quant_linear.cpp with the quants of each
// block regrouped (`pack_q8_layout`): for a group of 4 consecutive inputs, each column's 4
// quants side by side, so one 32-bit lane of a vector holds one column's 4 products.
// Q4_1: 4 groups of kNR x 4 bytes (low nibble: inputs 4g..4g+3, high nibble: 16 + 4g..);
// 8-bit layouts: 8 groups of kNR x 4 bytes.
//
// Q4_K has a layout of its own here, as compact as the file's (0.59 bytes a weight against
// Q4_1's 0.75): per panel, first each superblock's d and -dmin (kNR float32 each), then per
// block of 32 its 6-bit scale and minimum (kNR bytes each) and its regrouped nibbles; a block's
// dw = d * scale and mw = -dmin * min are made as the block is read (the same float32 products
// gguf_blocks' decoder makes, so the arithmetic above is unchanged). Q6_K likewise (0.83 bytes a
// weight against Q8_0h's 1.25): per superblock d; per block the int8 scales of its two halves,
// the low 4 bits of its quants as Q4_K's nibbles, and their high 2 bits, a byte holding those of
// inputs 4g + t, 16 + 4g + t, 8 + 4g + t and 24 + 4g + t (g = 0, 1; bits 0-1, 2-3, 4-5, 6-7).
//
// AVX2 (the AVX-512 builds too, 256 bits at a time): `maddubs` multiplies unsigned weight
// bytes by signed activation bytes and adds pairs into int16; signed weights (Q8_0, Q8_0h)
// go in as |w| against x carrying w's sign. int16 sums stay exact: a pair is at most
// 2 * 15 * 127 (Q4_1; eight added), 2 * 31 * 127 (Q8_0m; four), 2 * 32 * 127 (Q8_0h; four) or
// 2 * 128 * 127 (Q8_0; widened at once); `pack_q8_layout` refuses quants outside those ranges.
// With VNNI the products go straight into int32 sums instead (int8_dot.h: the same integers).
#include <atomic>
#include <tuple>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "int8_dot.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int kQ8Rows = 4;  // rows of x per tile
constexpr int kQ4_K = 4, kQ6_K = 5;  // the integer path's own layouts of Q4_K, Q6_K (above)
// Q4_1, Q8_0 and Q8_0m with their scales in float16 (kQ4_1 + kHalf, ...), where every scale is
// one exactly (those of Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 files): a fifth fewer bytes for Q4_1.
constexpr int kHalf = 6;
// Q5_0 and Q5_1 as compact as the file's (0.69 and 0.75 bytes a weight against 1.06 and 1.13 as
// Q8_0 / Q8_0m bytes): per block their float16 d (and m), the low 4 bits of the quants as Q4_1's
// nibbles, and the fifth bits, a byte for inputs 4g + t and 16 + 4g + t (g = 0..3: bits g and
// 4 + g) of a column (t = 0..3), laid out as one group's quants. Q5_0's quants less 16 are
// signed (the arithmetic of its Q8_0 form), Q5_1's unsigned with m (that of Q8_0m).
constexpr int kQ5_0 = 12, kQ5_1 = 13;
constexpr bool half_scales(int kind) { return kind >= kHalf; }
constexpr int quant_kind(int kind) {
  return kind >= kQ5_0 ? kind : half_scales(kind) ? kind - kHalf : kind;
}

constexpr int64_t q8_quants_offset(int kind) {
  return kind == kQ5_0 ? 2 * kNR
         : kind == kQ5_1 ? 4 * kNR
         : kind == kQ4_K || kind == kQ6_K ? 2 * kNR
         : half_scales(kind)             ? quants_offset(quant_kind(kind)) / 2
                                         : quants_offset(kind);
}
constexpr int64_t q8_block_bytes(int kind) {
  return kind == kQ5_0   ? 22 * kNR
         : kind == kQ5_1 ? 24 * kNR
         : kind == kQ4_K ? 18 * kNR
         : kind == kQ6_K   ? 26 * kNR
         : half_scales(kind) ? q8_quants_offset(kind) + packed_block_bytes(quant_kind(kind)) -
                                 quants_offset(quant_kind(kind))
                           : packed_block_bytes(kind);
}
// Bytes before a panel's first block: the superblocks' d (and -dmin).
constexpr int64_t q8_header_bytes(int kind, int64_t nb) {
  return kind == kQ4_K ? (nb / 8) * 8 * kNR : kind == kQ6_K ? (nb / 8) * 4 * kNR : 0;
}
// Where input j (0..31) of column c keeps its high 2 bits in a Q6_K block's high-bit bytes.
inline int64_t q6_high_offset(int64_t j, int64_t c) {
  return ((j % 16) / 4 % 2) * kNR * 4 + c * 4 + j % 4;
}
inline int q6_high_shift(int64_t j) { return ((j % 16) / 8) * 4 + (j / 16) * 2; }
// Where input j (0..31) of column c keeps its fifth bit in a Q5 block's high-bit bytes.
inline int64_t q5_high_offset(int64_t j, int64_t c) { return c * 4 + j % 4; }
inline int q5_high_shift(int64_t j) { return (j / 16) * 4 + (j % 16) / 4; }
constexpr int64_t q8_panel_bytes(int kind, int64_t nb) {
  return q8_header_bytes(kind, nb) + nb * q8_block_bytes(kind);
}
// "Q4_K", "Q6_K", a layout of quant_linear.cpp, or one of those with "f16" after it.
int q8_kind_of(const std::string& layout) {
  if (layout == "Q5_0" || layout == "Q5_1") return layout == "Q5_0" ? kQ5_0 : kQ5_1;
  const std::string base = strip_suffix(layout, "f16");
  if (!base.empty()) {
    const int kind = kind_of(base);
    TORCH_CHECK(kind != kQ8_0h, "Q8_0h has no float16-scale layout");
    return kind + kHalf;
  }
  return layout == "Q4_K" ? kQ4_K : layout == "Q6_K" ? kQ6_K : kind_of(layout);
}

// x quantized: q [m, k] int8, d [m, k / 32] float32, s [m, k / 32] int32.
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t k;
};

void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, float* d, int32_t* s) {
  const int64_t nb = k / kBlock;
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * k + b * kBlock;
        float amax = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int64_t j = 0; j < kBlock; ++j) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
          q[r * k + b * kBlock + j] = static_cast<int8_t>(v);
          sum += v;
        }
        d[r * nb + b] = amax / 127.f;
        s[r * nb + b] = sum;
      }
    }
  });
}

// Byte offset, in a block's regrouped quants, of column c's quant of input j (Q4_1: j < 16,
// the byte that also holds input j + 16).
inline int64_t q8_offset(int64_t j, int64_t c) { return (j / 4) * kNR * 4 + c * 4 + j % 4; }

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
    // Quants q + 32 rebuilt from nibbles and high bits, as |q| against x signed by q; the
    // first 16 inputs (low nibbles) and the last 16 (high nibbles) apart, four groups each.
    const __m256i mask = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
    const __m256i bias = _mm256_set1_epi8(32);
    DotSum first[R][kV], last[R][kV];
    for (int g = 0; g < 4; ++g) {
      __m256i lo[kV], hi[kV];
      for (int v = 0; v < kV; ++v) {
        const __m256i w =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + g * kNR * 4 + v * 32));
        const __m256i h = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(qw + 16 * kNR + (g % 2) * kNR * 4 + v * 32));
        const __m256i hl = _mm256_and_si256(_mm256_srli_epi16(h, (g / 2) * 4), two);
        const __m256i hh = _mm256_and_si256(_mm256_srli_epi16(h, (g / 2) * 4 + 2), two);
        lo[v] = _mm256_sub_epi8(
            _mm256_or_si256(_mm256_and_si256(w, mask), _mm256_slli_epi16(hl, 4)), bias);
        hi[v] = _mm256_sub_epi8(
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), mask),
                            _mm256_slli_epi16(hh, 4)),
            bias);
      }
      __m256i alo[kV], ahi[kV];
      for (int v = 0; v < kV; ++v) alo[v] = _mm256_abs_epi8(lo[v]), ahi[v] = _mm256_abs_epi8(hi[v]);
      for (int r = 0; r < R; ++r) {
        const __m256i xa = bcast(xq[r] + 4 * g), xb = bcast(xq[r] + 16 + 4 * g);
        for (int v = 0; v < kV; ++v) {
          first[r][v].add(alo[v], _mm256_sign_epi8(xa, lo[v]));
          settle(first[r][v]);
          last[r][v].add(ahi[v], _mm256_sign_epi8(xb, hi[v]));
          settle(last[r][v]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kV; ++v) {
        store(r, 0, v, first[r][v].widen());
        store(r, 1, v, last[r][v].widen());
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

// The largest |quant| each 8-bit layout's int16 sums allow (see the top of this file).
int32_t q8_bound(int kind) { return kind == kQ8_0m ? 31 : kind == kQ8_0h ? 32 : 128; }

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

// A tensor packed by pack_gguf_weight / pack_gguf_parts in `layout`, its quants regrouped for
// gguf_linear_q8; with half_scales, its scales in float16 where every one of them is exactly
// one. Returns (packed, the layout's name: `layout`, or `layout` + "f16").
std::tuple<torch::Tensor, std::string> pack_q8_layout(const torch::Tensor& packed,
                                                      const std::string& layout, int64_t n,
                                                      int64_t k, bool half_scales) {
  TORCH_CHECK(layout != "Q4_K" && layout != "Q6_K",
              layout, " blocks are packed for the integer path by pack_q4_k_q8 / pack_q6_k_q8");
  const int kind = kind_of(layout);
  TORCH_CHECK(k % kBlock == 0, "k must be a multiple of 32 (got ", k, ")");
  const int64_t panels = (n + kNR - 1) / kNR, nb = k / kBlock, bytes = packed_block_bytes(kind);
  TORCH_CHECK(packed.numel() == panels * nb * bytes, "packed weights are not ", n, " x ", k,
              " of ", layout);
  const torch::Tensor src = packed.contiguous();
  const uint8_t* in = src.data_ptr<uint8_t>();
  const int64_t offset = quants_offset(kind), scales = offset / 4;  // float32 scales a block
  if (half_scales && kind != kQ8_0h) {
    std::atomic<bool> exact{true};
    at::parallel_for(0, panels * nb, 64, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1 && exact.load(std::memory_order_relaxed); ++b) {
        const float* d = reinterpret_cast<const float*>(in + b * bytes);
        for (int64_t i = 0; i < scales; ++i)
          if (static_cast<float>(static_cast<c10::Half>(d[i])) != d[i] && !std::isnan(d[i]))
            exact = false;
      }
    });
    half_scales = exact.load();
  } else {
    half_scales = false;
  }
  const int q8_kind = half_scales ? kind + kHalf : kind;
  const int64_t out_bytes = q8_block_bytes(q8_kind), out_offset = q8_quants_offset(q8_kind);
  torch::Tensor out = torch::zeros({panels * nb * out_bytes}, src.options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t inputs = kind == kQ4_1 ? 16 : kBlock;
  const int32_t bound = q8_bound(kind);
  std::atomic<bool> in_range{true};
  at::parallel_for(0, panels * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = in + b * bytes;
      uint8_t* o = dst + b * out_bytes;
      if (half_scales) {
        const float* d = reinterpret_cast<const float*>(blk);
        uint16_t* h = reinterpret_cast<uint16_t*>(o);
        for (int64_t i = 0; i < scales; ++i) h[i] = static_cast<c10::Half>(d[i]).x;
      } else {
        std::memcpy(o, blk, offset);
      }
      const uint8_t* q = blk + offset;
      for (int64_t j = 0; j < inputs; ++j)
        for (int64_t c = 0; c < kNR; ++c) {
          const uint8_t v = q[j * kNR + c];
          o[out_offset + q8_offset(j, c)] = v;
          if (kind == kQ8_0m && v > bound) in_range = false;
          if (kind == kQ8_0h && std::abs(static_cast<int8_t>(v)) > bound) in_range = false;
        }
    }
  });
  TORCH_CHECK(in_range.load(), "the ", layout, " layout's quants exceed ", bound,
              " in magnitude, which the integer path's int16 sums cannot hold");
  return {out, half_scales ? layout + "f16" : layout};
}

// A compact layout's packed tensor (Q4_K, Q6_K) of n rows of nb blocks: fill(sb, blk, row, b, c)
// writes column c's part of block b of `row` into blk, and of its superblock's scales into sb;
// the packers differ only in what they write where.
template <typename Fill>
torch::Tensor pack_compact(int64_t n, int64_t nb, int kind, const torch::TensorOptions& options,
                           Fill&& fill) {
  const int64_t panels = (n + kNR - 1) / kNR, panel_bytes = q8_panel_bytes(kind, nb);
  // bytes of one superblock's scales (none in the Q5 layouts, whose rows may be shorter)
  const int64_t header = nb >= 8 ? q8_header_bytes(kind, nb) / (nb / 8) : 0;
  torch::Tensor packed = torch::zeros({panels * panel_bytes}, options);
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* panel = out + p * panel_bytes;
      uint8_t* blocks = panel + q8_header_bytes(kind, nb);
      for (int64_t c = 0; c < kNR && p * kNR + c < n; ++c)
        for (int64_t b = 0; b < nb; ++b)
          fill(panel + (b / 8) * header, blocks + b * q8_block_bytes(kind), p * kNR + c, b, c);
    }
  });
  return packed;
}

// Q4_K blocks decoded into their parts (gguf_blocks.k_parts: d and dmin float32 [n, k / 256],
// 6-bit scales and minimums uint8 [n, k / 32], quants uint8 [n, k] in 0..15) in the integer
// path's Q4_K layout.
torch::Tensor pack_q4_k_q8(const torch::Tensor& d, const torch::Tensor& dmin,
                           const torch::Tensor& scales, const torch::Tensor& mins,
                           const torch::Tensor& quants) {
  TORCH_CHECK(quants.dim() == 2 && quants.scalar_type() == torch::kUInt8, "uint8 [n, k] quants");
  const int64_t n = quants.size(0), k = quants.size(1), nb = k / kBlock;
  TORCH_CHECK(k % 256 == 0, "Q4_K rows are whole superblocks of 256 (got ", k, ")");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.sizes() == dmin.sizes() &&
                  dmin.scalar_type() == torch::kFloat32 && d.dim() == 2 && d.size(0) == n &&
                  d.size(1) == nb / 8,
              "float32 [n, k / 256] d and dmin");
  TORCH_CHECK(scales.scalar_type() == torch::kUInt8 && mins.scalar_type() == torch::kUInt8 &&
                  scales.dim() == 2 && scales.size(0) == n && scales.size(1) == nb &&
                  mins.sizes() == scales.sizes(),
              "uint8 [n, k / 32] scales and mins");
  const torch::Tensor dc = d.contiguous(), mc = dmin.contiguous(), sc = scales.contiguous(),
                      mn = mins.contiguous(), q = quants.contiguous();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  const uint8_t *sp = sc.data_ptr<uint8_t>(), *np = mn.data_ptr<uint8_t>(), *qp = q.data_ptr<uint8_t>();
  return pack_compact(n, nb, kQ4_K, quants.options(), [&](uint8_t* sb, uint8_t* blk, int64_t row,
                                                         int64_t b, int64_t c) {
    if (b % 8 == 0) {
      reinterpret_cast<float*>(sb)[c] = dp[row * (nb / 8) + b / 8];
      reinterpret_cast<float*>(sb)[kNR + c] = -mp[row * (nb / 8) + b / 8];
    }
    blk[c] = sp[row * nb + b];
    blk[kNR + c] = np[row * nb + b];
    const uint8_t* src = qp + row * k + b * kBlock;
    for (int64_t j = 0; j < 16; ++j)
      blk[2 * kNR + q8_offset(j, c)] = static_cast<uint8_t>((src[j] & 0x0F) | (src[j + 16] << 4));
  });
}

// Q6_K blocks decoded into their parts (gguf_blocks.q6_k_parts: d float32 [n, k / 256], int8
// scales [n, k / 16], quants + 32 uint8 [n, k] in 0..63) in the integer path's Q6_K layout.
torch::Tensor pack_q6_k_q8(const torch::Tensor& d, const torch::Tensor& scales,
                           const torch::Tensor& quants) {
  TORCH_CHECK(quants.dim() == 2 && quants.scalar_type() == torch::kUInt8, "uint8 [n, k] quants");
  const int64_t n = quants.size(0), k = quants.size(1), nb = k / kBlock;
  TORCH_CHECK(k % 256 == 0, "Q6_K rows are whole superblocks of 256 (got ", k, ")");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.dim() == 2 && d.size(0) == n &&
                  d.size(1) == nb / 8,
              "float32 [n, k / 256] d");
  TORCH_CHECK(scales.scalar_type() == torch::kInt8 && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) == 2 * nb,
              "int8 [n, k / 16] scales");
  const torch::Tensor dc = d.contiguous(), sc = scales.contiguous(), q = quants.contiguous();
  const float* dp = dc.data_ptr<float>();
  const int8_t* sp = sc.data_ptr<int8_t>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  return pack_compact(n, nb, kQ6_K, quants.options(), [&](uint8_t* sb, uint8_t* blk, int64_t row,
                                                         int64_t b, int64_t c) {
    if (b % 8 == 0) reinterpret_cast<float*>(sb)[c] = dp[row * (nb / 8) + b / 8];
    blk[c] = static_cast<uint8_t>(sp[row * 2 * nb + 2 * b]);
    blk[kNR + c] = static_cast<uint8_t>(sp[row * 2 * nb + 2 * b + 1]);
    const uint8_t* src = qp + row * k + b * kBlock;
    for (int64_t j = 0; j < 16; ++j)
      blk[2 * kNR + q8_offset(j, c)] =
          static_cast<uint8_t>((src[j] & 0x0F) | ((src[j + 16] & 0x0F) << 4));
    for (int64_t j = 0; j < kBlock; ++j)
      blk[18 * kNR + q6_high_offset(j, c)] |=
          static_cast<uint8_t>(((src[j] >> 4) & 3) << q6_high_shift(j));
  });
}

// Q5_0 or Q5_1 blocks decoded into their parts (gguf_blocks.decode: d, and for Q5_1 m, float32
// [n, k / 32], each one a float16; quants uint8 [n, k] in 0..31, Q5_0's before it takes 16) in
// the integer path's compact Q5 layouts.
torch::Tensor pack_q5_q8(const torch::Tensor& d, const c10::optional<torch::Tensor>& m,
                         const torch::Tensor& quants) {
  TORCH_CHECK(quants.dim() == 2 && quants.scalar_type() == torch::kUInt8, "uint8 [n, k] quants");
  const int64_t n = quants.size(0), k = quants.size(1), nb = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "Q5 rows are whole blocks of 32 (got ", k, ")");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.dim() == 2 && d.size(0) == n &&
                  d.size(1) == nb && (!m.has_value() || m->sizes() == d.sizes()),
              "float32 [n, k / 32] d (and m)");
  const int kind = m.has_value() ? kQ5_1 : kQ5_0;
  const torch::Tensor dc = d.contiguous(), q = quants.contiguous();
  const torch::Tensor mc = m.has_value() ? m->to(torch::kFloat32).contiguous() : dc;
  const float *dp = dc.data_ptr<float>(), *mp = mc.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  std::atomic<bool> ok{true};
  torch::Tensor packed = pack_compact(n, nb, kind, quants.options(), [&](uint8_t*, uint8_t* blk,
                                                                         int64_t row, int64_t b,
                                                                         int64_t c) {
    const float scale = dp[row * nb + b], min = mp[row * nb + b];
    const c10::Half hd(scale), hm(min);
    if (static_cast<float>(hd) != scale || (kind == kQ5_1 && static_cast<float>(hm) != min))
      ok = false;
    reinterpret_cast<uint16_t*>(blk)[c] = hd.x;
    if (kind == kQ5_1) reinterpret_cast<uint16_t*>(blk)[kNR + c] = hm.x;
    uint8_t* qs = blk + q8_quants_offset(kind);
    const uint8_t* src = qp + row * k + b * kBlock;
    for (int64_t j = 0; j < 16; ++j)
      qs[q8_offset(j, c)] = static_cast<uint8_t>((src[j] & 0x0F) | ((src[j + 16] & 0x0F) << 4));
    for (int64_t j = 0; j < kBlock; ++j) {
      if (src[j] > 31) ok = false;
      qs[16 * kNR + q5_high_offset(j, c)] |= static_cast<uint8_t>(((src[j] >> 4) & 1) << q5_high_shift(j));
    }
  });
  TORCH_CHECK(ok.load(), "Q5 blocks need float16 scales and quants in 0..31");
  return packed;
}

// x @ w.T (+ bias) with x quantized to 8 bits per block of 32 (quantize_q8's q, d, s) over
// weights regrouped by pack_q8_layout; float32 out, or bfloat16.
torch::Tensor gguf_linear_q8(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& s,
                             const torch::Tensor& packed, const std::string& layout, int64_t n,
                             const c10::optional<torch::Tensor>& bias, bool bf16_out) {
  const int kind = q8_kind_of(layout);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(),
              "q must be contiguous int8 [m, k]");
  const int64_t m = q.size(0), k = q.size(1), nb = k / kBlock;
  TORCH_CHECK(k % kBlock == 0 && d.scalar_type() == torch::kFloat32 && d.is_contiguous() &&
                  d.numel() == m * nb && s.scalar_type() == torch::kInt32 &&
                  s.is_contiguous() && s.numel() == m * nb,
              "d and s must be contiguous float32 and int32 [m, k / 32] (quantize_q8)");
  const int64_t panels = (n + kNR - 1) / kNR;
  TORCH_CHECK((kind != kQ4_K && kind != kQ6_K) || nb % 8 == 0,
              layout, " rows are whole superblocks of 256");
  TORCH_CHECK(packed.numel() == panels * q8_panel_bytes(kind, nb), "packed weights are not ", n,
              " x ", k, " of ", layout, " from pack_q8_layout or pack_q4_k_q8");
  const Q8Rows x{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), k};
  torch::Tensor out =
      torch::empty({m, n}, q.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (m > 0) {
    auto go = [&](auto kind_tag) {
      constexpr int K = decltype(kind_tag)::value;
      if (bf16_out) run_q8<K>(x, m, w, n, out.data_ptr<at::BFloat16>());
      else run_q8<K>(x, m, w, n, out.data_ptr<float>());
    };
    if (kind == kQ4_1) go(std::integral_constant<int, kQ4_1>{});
    else if (kind == kQ4_K) go(std::integral_constant<int, kQ4_K>{});
    else if (kind == kQ6_K) go(std::integral_constant<int, kQ6_K>{});
    else if (kind == kQ8_0) go(std::integral_constant<int, kQ8_0>{});
    else if (kind == kQ8_0m) go(std::integral_constant<int, kQ8_0m>{});
    else if (kind == kQ8_0h) go(std::integral_constant<int, kQ8_0h>{});
    else if (kind == kQ4_1 + kHalf) go(std::integral_constant<int, kQ4_1 + kHalf>{});
    else if (kind == kQ8_0 + kHalf) go(std::integral_constant<int, kQ8_0 + kHalf>{});
    else if (kind == kQ5_0) go(std::integral_constant<int, kQ5_0>{});
    else if (kind == kQ5_1) go(std::integral_constant<int, kQ5_1>{});
    else go(std::integral_constant<int, kQ8_0m + kHalf>{});
  }
  if (bias.has_value()) out.add_(*bias);
  return out;
}

// gguf_linear for a layout named "<layout>+q8": x quantized here, then gguf_linear_q8.
torch::Tensor gguf_linear_int8(const torch::Tensor& x, const torch::Tensor& packed,
                               const std::string& layout, int64_t n,
                               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "float32 or bfloat16 x");
  const std::vector<torch::Tensor> q = quantize_q8(x);
  return gguf_linear_q8(q[0], q[1], q[2], packed, layout, n, bias,
                        x.scalar_type() == torch::kBFloat16);
}

// x @ w.T (+ bias) for a weight in parts stacked by rows (packed for gguf_linear, or dense with
// kind ""), their outputs side by side; x is quantized once for all the integer-path parts.
torch::Tensor linear_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& data,
                           const std::vector<std::string>& kinds, const std::vector<int64_t>& ns,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!data.empty() && data.size() == kinds.size() && data.size() == ns.size(),
              "one kind and one row count per part");
  auto is_q8 = [](const std::string& kind) { return !q8_layout(kind).empty(); };
  std::vector<torch::Tensor> quantized;
  if (std::any_of(kinds.begin(), kinds.end(), is_q8)) quantized = quantize_q8(x);
  const c10::optional<torch::Tensor> none;
  std::vector<torch::Tensor> outs;
  for (size_t i = 0; i < data.size(); ++i) {
    const std::string& kind = kinds[i];
    if (is_q8(kind))
      outs.push_back(gguf_linear_q8(quantized[0], quantized[1], quantized[2], data[i],
                                    q8_layout(kind), ns[i], none,
                                    x.scalar_type() == torch::kBFloat16));
    else if (kind.empty()) outs.push_back(packed_linear(x, data[i], ns[i], none));
    else outs.push_back(gguf_linear(x, data[i], kind, ns[i], none));
  }
  torch::Tensor out = torch::cat(outs, 1);
  if (bias.has_value()) out.add_(*bias);
  return out;
}

#pragma GCC pop_options

void register_quant_int8(pybind11::module& m) {
  m.def("quantize_q8", &quantize_q8,
        "rows quantized per block of 32 to 8 bits: (q int8, d float32, s = sum q int32)");
  m.def("pack_q8_layout", &pack_q8_layout,
        "gguf_linear's packed weights with each block's quants regrouped for gguf_linear_q8, "
        "and with half_scales their scales in float16 where all are exact: (packed, layout)");
  m.def("pack_q4_k_q8", &pack_q4_k_q8,
        "Q4_K blocks' parts (d, dmin, 6-bit scales and minimums, quants) in the integer path's "
        "compact Q4_K layout");
  m.def("pack_q6_k_q8", &pack_q6_k_q8,
        "Q6_K blocks' parts (d, int8 scales per 16, quants + 32) in the integer path's compact "
        "Q6_K layout");
  m.def("pack_q5_q8", &pack_q5_q8,
        "Q5_0 / Q5_1 blocks' parts (d, m for Q5_1, quants in 0..31) in the integer path's compact "
        "Q5 layouts", pybind11::arg("d"), pybind11::arg("m"), pybind11::arg("quants"));
  m.def("linear_parts", &linear_parts,
        "x @ w.T (+ bias) for a weight in parts stacked by rows (x quantized once for all "
        "integer-path parts)");
  m.def("int8_vnni", [] { return spectral_cpu::kVnni; },
        "how the integer path's tiles add products: 1 VNNI (vpdpbusd), 2 its AVX2 emulation "
        "(a test build), 0 maddubs into int16");
  m.def("gguf_linear_q8", &gguf_linear_q8,
        "x @ w.T (+ bias) from x quantized by quantize_q8, in integer dot products per block");
}
