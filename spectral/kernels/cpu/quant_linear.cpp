// y = x @ w.T (+ bias) over GGUF blocks kept as they are (4 or 8 bits a weight), expanded in
// registers: Q4_1 (w = d * q + m, q in 0..15), Q4_0 (w = d * (q - 8)) and Q8_0 (w = d * q, q in
// -128..127), 32 weights of one row a block, fp16 d and m. Q4_0 is packed as Q4_1 with
// m = -8 d: d * q and 8 d are exact in float32 and so is their difference, so the one fused
// multiply-add gives d * (q - 8) exactly. Other formats are decoded by the caller into a
// float32 d (and m) and a quant per weight of one of four layouts (`pack_gguf_parts`): 4-bit
// with m (Q4_1: Q4_K), 8-bit (Q8_0: Q5_0), 8-bit with m (Q8_0m: Q5_1, Q5_K) and 8-bit with a d
// per 16 weights (Q8_0h: Q6_K).
//
// Packed layout, as packed_linear's (panels of kNR output columns, one micro-kernel), per panel
// and per block of 32 inputs: the kNR columns' d (and m) as float32, then their quants side by
// side per input: Q4_1 in 16 rows of kNR bytes, byte c of row j holding column c's quant of
// input j (low nibble) and of input j + 16 (high nibble), as GGUF pairs them; Q8_0 in 32 rows of
// kNR int8. d * q is exact in float32 (11 by at most 8 significant bits), so the expanded weight
// (one fused multiply-add with m) is bit-equal to gguf's own dequantization in float32, and with
// `round_bf16` it is rounded to bfloat16 first, bit-equal to dequantize-then-cast.
#include <ATen/ATen.h>
#include <torch/python.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel_tile.h"

namespace {

using namespace spectral_cpu;

constexpr int64_t kBlock = 32;
constexpr int kQ4_1 = 0, kQ8_0 = 1, kQ8_0m = 2, kQ8_0h = 3;  // the packed layouts

// A GGUF block type as stored and the packed layout it becomes.
struct Format {
  int kind;
  int64_t block_bytes;  // one GGUF block
  bool has_min;         // Q4_1: fp16 m after d; Q4_0: m = -8 d
};

// Bytes of one packed block of a panel: scales (and mins), then quants.
// (Q8_0m: d then m; Q8_0h: the d of the first 16 weights, then the d of the last 16.)
constexpr int64_t packed_block_bytes(int kind) {
  return kind == kQ4_1 ? kNR * 8 + 16 * kNR : kind == kQ8_0 ? kNR * 4 + 32 * kNR : kNR * 8 + 32 * kNR;
}

// Where a packed block's quants start (after d, and m where the layout has it).
constexpr int64_t quants_offset(int kind) { return kind == kQ8_0 ? kNR * 4 : kNR * 8; }

float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

float round_to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

#if defined(SPECTRAL_VEC)
// kLanes quants starting at p widened to float32: unsigned bytes, or signed.
#if SPECTRAL_VEC == 512
inline Vec::R widen_u8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
inline Vec::R widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// Low and high nibbles of kNR bytes, each as two vectors of kLanes floats.
inline void nibbles(const uint8_t* p, Vec::R lo[2], Vec::R hi[2]) {
  const __m256i b = _mm256_loadu_si256((const __m256i*)p);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i l = _mm256_and_si256(b, mask), h = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
  lo[0] = widen_u8(_mm256_castsi256_si128(l));
  lo[1] = widen_u8(_mm256_extracti128_si256(l, 1));
  hi[0] = widen_u8(_mm256_castsi256_si128(h));
  hi[1] = widen_u8(_mm256_extracti128_si256(h, 1));
}
inline Vec::R round_bf16(Vec::R v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF0000u)));
}
#else
inline Vec::R widen_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline Vec::R widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline void nibbles(const uint8_t* p, Vec::R lo[2], Vec::R hi[2]) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i l = _mm_and_si128(b, mask), h = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  lo[0] = widen_u8(l);
  lo[1] = widen_u8(_mm_srli_si128(l, 8));
  hi[0] = widen_u8(h);
  hi[1] = widen_u8(_mm_srli_si128(h, 8));
}
inline Vec::R round_bf16(Vec::R v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF0000u)));
}
#endif

#endif

// Calls use(i, w, half) for every input i of the panel, w its kNR expanded weights (two
// vectors, or a kNR array without a vector unit); `half` (0 or 1, a constant at each call)
// alternates between consecutive calls, so a caller can spread its sums over two sets of
// accumulators.
template <int Kind, typename Use>
inline void expand(const uint8_t* panel, int64_t k, bool bf16, Use&& use) {
  const int64_t blocks = k / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = panel + b * packed_block_bytes(Kind);
    prefetch_ahead(blk, packed_block_bytes(Kind));
    const float* d = reinterpret_cast<const float*>(blk);
    const int64_t i0 = b * kBlock;
#if defined(SPECTRAL_VEC)
    const Vec::R d0 = Vec::load(d), d1 = Vec::load(d + kLanes);
    if constexpr (Kind == kQ4_1) {
      const Vec::R m0 = Vec::load(d + kNR), m1 = Vec::load(d + kNR + kLanes);
      const uint8_t* q = blk + kNR * 8;
      for (int64_t j = 0; j < 16; ++j) {
        Vec::R ql[2], qh[2];
        nibbles(q + j * kNR, ql, qh);
        Vec::R w0 = Vec::fma(d0, ql[0], m0), w1 = Vec::fma(d1, ql[1], m1);
        if (bf16) w0 = round_bf16(w0), w1 = round_bf16(w1);
        use(i0 + j, w0, w1, 0);
        w0 = Vec::fma(d0, qh[0], m0), w1 = Vec::fma(d1, qh[1], m1);
        if (bf16) w0 = round_bf16(w0), w1 = round_bf16(w1);
        use(i0 + j + 16, w0, w1, 1);
      }
    } else {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + quants_offset(Kind));
      const Vec::R m0 = Kind == kQ8_0m ? Vec::load(d + kNR) : Vec::zero();
      const Vec::R m1 = Kind == kQ8_0m ? Vec::load(d + kNR + kLanes) : Vec::zero();
      const Vec::R e0 = Kind == kQ8_0h ? Vec::load(d + kNR) : d0;  // the last 16 weights' d
      const Vec::R e1 = Kind == kQ8_0h ? Vec::load(d + kNR + kLanes) : d1;
      auto weights = [&](int64_t j, Vec::R& w0, Vec::R& w1) {
        w0 = Vec::fma(j < 16 ? d0 : e0, widen_i8(q + j * kNR), m0);
        w1 = Vec::fma(j < 16 ? d1 : e1, widen_i8(q + j * kNR + kLanes), m1);
        if (bf16) w0 = round_bf16(w0), w1 = round_bf16(w1);
      };
      for (int64_t j = 0; j < kBlock; j += 2) {
        Vec::R w0, w1;
        weights(j, w0, w1);
        use(i0 + j, w0, w1, 0);
        weights(j + 1, w0, w1);
        use(i0 + j + 1, w0, w1, 1);
      }
    }
#else
    for (int64_t j = 0; j < kBlock; ++j) {
      float w[kNR];
      for (int64_t c = 0; c < kNR; ++c) {
        if constexpr (Kind == kQ4_1) {
          const uint8_t byte = blk[kNR * 8 + (j % 16) * kNR + c];
          const float q = static_cast<float>(j < 16 ? byte & 0x0F : byte >> 4);
          w[c] = std::fma(d[c], q, d[kNR + c]);
        } else {
          const float q = reinterpret_cast<const int8_t*>(blk + quants_offset(Kind))[j * kNR + c];
          if constexpr (Kind == kQ8_0m) w[c] = std::fma(d[c], q, d[kNR + c]);
          else if constexpr (Kind == kQ8_0h) w[c] = (j < 16 ? d[c] : d[kNR + c]) * q;
          else w[c] = d[c] * q;
        }
        if (bf16) w[c] = round_to_bf16(w[c]);
      }
      use(i0 + j, w, static_cast<int>(j & 1));
    }
#endif
  }
}

// The R x kNR tile over one packed panel, into out[R][kNR], expanding each weight once;
// alternate inputs go to accumulator_sets<R>() sets of accumulators.
template <int Kind, int R>
void tile(const float* x, int64_t k, const uint8_t* panel, bool bf16, float* out) {
#if defined(SPECTRAL_VEC)
  constexpr int kSets = accumulator_sets<R>();
  Vec::R lo[kSets][R], hi[kSets][R];
  for (int s = 0; s < kSets; ++s)
    for (int r = 0; r < R; ++r) lo[s][r] = hi[s][r] = Vec::zero();
  expand<Kind>(panel, k, bf16, [&](int64_t i, Vec::R w0, Vec::R w1, int half) {
    accumulate<R>(lo[half % kSets], hi[half % kSets], x, k, i, w0, w1);
  });
  store_sums<R, kSets>(lo, hi, out);
#else
  for (int r = 0; r < R * kNR; ++r) out[r] = 0.f;
  expand<Kind>(panel, k, bf16, [&](int64_t i, const float* w, int) {
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kNR; ++c) out[r * kNR + c] += x[r * k + i] * w[c];
  });
#endif
}

// The panel's weights expanded into dense[k][kNR] (float32), for many rows of x.
template <int Kind>
void expand_panel(const uint8_t* panel, int64_t k, bool bf16, float* dense) {
#if defined(SPECTRAL_VEC)
  expand<Kind>(panel, k, bf16, [&](int64_t i, Vec::R w0, Vec::R w1, int) {
    Vec::store(dense + i * kNR, w0);
    Vec::store(dense + i * kNR + kLanes, w1);
  });
#else
  expand<Kind>(panel, k, bf16, [&](int64_t i, const float* w, int) {
    for (int64_t c = 0; c < kNR; ++c) dense[i * kNR + c] = w[c];
  });
#endif
}

template <int Kind, int R = kMR>
void tile_rows(int rows, const float* x, int64_t k, const uint8_t* panel, bool bf16, float* out) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<Kind, R - 1>(rows, x, k, panel, bf16, out);
  }
  tile<Kind, R>(x, k, panel, bf16, out);
}

#if defined(SPECTRAL_VEC)
// One float32 row over one panel without expanding the weights: per block, d * sum(x q) plus
// m * sum(x) (`xsum`, per block). The same sum as over the expanded weights, in another order;
// for a one-hot x it is exactly the expanded weight (d * q is exact, one rounding adds m).
// Saves the expanding multiply-add per weight (measured: the Q8_0 LM head at one row 2.0 ->
// 1.35 ms, float32 on AVX2).
template <int Kind>
void row_tile(const float* x, int64_t k, const uint8_t* panel, const float* xsum, float* out) {
  Vec::R t0 = Vec::zero(), t1 = Vec::zero();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* blk = panel + b * packed_block_bytes(Kind);
    prefetch_ahead(blk, packed_block_bytes(Kind));
    const float* d = reinterpret_cast<const float*>(blk);
    const float* xb = x + b * kBlock;
    // Two sets of sums (alternate inputs), so that their multiply-adds overlap.
    Vec::R s00 = Vec::zero(), s01 = Vec::zero(), s10 = Vec::zero(), s11 = Vec::zero();
    if constexpr (Kind == kQ4_1) {
      const uint8_t* q = blk + kNR * 8;
      for (int64_t j = 0; j < 16; ++j) {
        Vec::R ql[2], qh[2];
        nibbles(q + j * kNR, ql, qh);
        const Vec::R xl = Vec::set1(xb[j]), xh = Vec::set1(xb[j + 16]);
        s00 = Vec::fma(xl, ql[0], s00), s01 = Vec::fma(xl, ql[1], s01);
        s10 = Vec::fma(xh, qh[0], s10), s11 = Vec::fma(xh, qh[1], s11);
      }
    } else {
      // Q8_0h: s0x sum the first 16 weights, s1x the last 16 (their own d); else alternate.
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + quants_offset(Kind));
      for (int64_t j = 0; j < kBlock; j += 2) {
        const int64_t a = Kind == kQ8_0h ? j / 2 : j, b2 = Kind == kQ8_0h ? j / 2 + 16 : j + 1;
        const Vec::R xl = Vec::set1(xb[a]), xh = Vec::set1(xb[b2]);
        s00 = Vec::fma(xl, widen_i8(q + a * kNR), s00);
        s01 = Vec::fma(xl, widen_i8(q + a * kNR + kLanes), s01);
        s10 = Vec::fma(xh, widen_i8(q + b2 * kNR), s10);
        s11 = Vec::fma(xh, widen_i8(q + b2 * kNR + kLanes), s11);
      }
    }
    if constexpr (Kind == kQ8_0h) {
      t0 = Vec::fma(Vec::load(d), s00, t0);
      t1 = Vec::fma(Vec::load(d + kLanes), s01, t1);
      t0 = Vec::fma(Vec::load(d + kNR), s10, t0);
      t1 = Vec::fma(Vec::load(d + kNR + kLanes), s11, t1);
    } else {
      t0 = Vec::fma(Vec::load(d), Vec::add(s00, s10), t0);
      t1 = Vec::fma(Vec::load(d + kLanes), Vec::add(s01, s11), t1);
    }
    if constexpr (Kind == kQ4_1 || Kind == kQ8_0m) {
      const Vec::R xs = Vec::set1(xsum[b]);
      t0 = Vec::fma(Vec::load(d + kNR), xs, t0);
      t1 = Vec::fma(Vec::load(d + kNR + kLanes), xs, t1);
    }
  }
  Vec::store(out, t0);
  Vec::store(out + kLanes, t1);
}
#endif

// One float32 row: row_tile. Up to one tile of rows: each weight expanded as the tile uses it
// (read once from memory). More rows: each panel expanded once into a float32 buffer that every
// row block then reads.
template <int Kind, typename O>
void run(const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, bool bf16,
         O* out) {
  const int64_t panels = (n + kNR - 1) / kNR, panel_bytes = (k / kBlock) * packed_block_bytes(Kind);
#if defined(SPECTRAL_VEC)
  if (m == 1 && !bf16) {  // bfloat16 needs each weight expanded, to round it
    std::vector<float> xsum(k / kBlock, 0.f);
    for (int64_t i = 0; i < k; ++i) xsum[i / kBlock] += x[i];
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      alignas(64) float buf[kNR];
      for (int64_t p = p0; p < p1; ++p) {
        row_tile<Kind>(x, k, packed + p * panel_bytes, xsum.data(), buf);
        store_tile(buf, 1, 0, n, p * kNR, out, n);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float buf[kMR * kNR];
    std::vector<float> dense(m > kMR ? k * kNR : 0);
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = packed + p * panel_bytes;
      if (m > kMR) {
        expand_panel<Kind>(panel, k, bf16, dense.data());
        panel_rows(x, m, k, dense.data(), n, p * kNR, out);
      } else {
        tile_rows<Kind>(static_cast<int>(m), x, k, panel, bf16, buf);
        store_tile(buf, static_cast<int>(m), 0, n, p * kNR, out, n);
      }
    }
  });
}

Format format_of(const std::string& name) {
  if (name == "Q4_0") return {kQ4_1, 18, false};
  if (name == "Q4_1") return {kQ4_1, 20, true};
  if (name == "Q8_0") return {kQ8_0, 34, false};
  TORCH_CHECK(false, "GGUF block type ", name, " is not implemented (Q4_0, Q4_1, Q8_0 are)");
}

// The packed layout a name gives: a format packed as it is stored, or a layout of decoded parts.
int kind_of(const std::string& name) {
  if (name == "Q8_0m") return kQ8_0m;
  if (name == "Q8_0h") return kQ8_0h;
  return format_of(name).kind;
}

// The packed tensor of n rows of nblocks blocks in layout `kind`: fill(dst, row, b, c) writes
// column c's d (at dst, as float32 [kNR]), m and quants of block b of `row` into the panel block
// at dst, for every row; the packers differ only in where they read.
template <typename Fill>
torch::Tensor pack_panels(int64_t n, int64_t nblocks, int kind, const torch::TensorOptions& options,
                          Fill&& fill) {
  const int64_t panels = (n + kNR - 1) / kNR, out_block = packed_block_bytes(kind);
  torch::Tensor packed = torch::zeros({panels * nblocks * out_block}, options);
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t b = 0; b < nblocks; ++b)
        for (int64_t c = 0; c < kNR && p * kNR + c < n; ++c)
          fill(out + (p * nblocks + b) * out_block, p * kNR + c, b, c);
  });
  return packed;
}

}  // namespace

// blocks: uint8 [n, k / 32 * block bytes], a GGUF tensor's rows as stored.
torch::Tensor pack_gguf_weight(const torch::Tensor& blocks, const std::string& type, int64_t k) {
  const Format format = format_of(type);
  const int kind = format.kind;
  const int64_t block_bytes = format.block_bytes;
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8, "uint8 [n, bytes] rows");
  TORCH_CHECK(k % kBlock == 0, "k must be a multiple of 32 (got ", k, ")");
  const int64_t n = blocks.size(0), nblocks = k / kBlock;
  TORCH_CHECK(blocks.size(1) == nblocks * block_bytes, "rows of ", blocks.size(1),
              " bytes hold no ", k, " weights of ", type);
  const torch::Tensor src = blocks.contiguous();
  const uint8_t* in = src.data_ptr<uint8_t>();
  return pack_panels(n, nblocks, kind, blocks.options(), [&](uint8_t* dst, int64_t row, int64_t b,
                                                               int64_t c) {
    float* d = reinterpret_cast<float*>(dst);
    const uint8_t* blk = in + (row * nblocks + b) * block_bytes;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    d[c] = half_to_float(h);
    if (kind == kQ4_1) {
      const int64_t quants = format.has_min ? 4 : 2;
      if (format.has_min) std::memcpy(&h, blk + 2, 2);
      d[kNR + c] = format.has_min ? half_to_float(h) : -8.f * d[c];
      for (int64_t j = 0; j < 16; ++j) dst[kNR * 8 + j * kNR + c] = blk[quants + j];
    } else {
      for (int64_t j = 0; j < kBlock; ++j) dst[kNR * 4 + j * kNR + c] = blk[2 + j];
    }
  });
}

// scales, mins: float32 [n, k / 32], one d (and m) per 32 weights (Q8_0h: scales [n, k / 16], a
// d per 16); quants: uint8 [n, k], values 0..15 for the Q4_1 layout, int8 bits for the others.
// w = d * q (+ m) is what gguf_linear expands: exactly gguf's value where d * q is exact in
// float32, or (Q6_K) where gguf too rounds d * q once.
torch::Tensor pack_gguf_parts(const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                              const torch::Tensor& quants, const std::string& layout) {
  const int kind = kind_of(layout);
  TORCH_CHECK(layout != "Q4_0", "layouts: Q4_1, Q8_0, Q8_0m, Q8_0h (got ", layout, ")");
  TORCH_CHECK(quants.dim() == 2 && quants.scalar_type() == torch::kUInt8, "uint8 [n, k] quants");
  const int64_t n = quants.size(0), k = quants.size(1), nblocks = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "k must be a multiple of 32 (got ", k, ")");
  const int64_t per_block = kind == kQ8_0h ? 2 : 1;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == nblocks * per_block,
              "float32 [n, k / ", kBlock / per_block, "] scales");
  const bool with_min = kind == kQ4_1 || kind == kQ8_0m;
  TORCH_CHECK(mins.has_value() == with_min, "the ", layout, " layout ",
              with_min ? "needs" : "takes no", " mins");
  if (with_min)
    TORCH_CHECK(mins->scalar_type() == torch::kFloat32 && mins->sizes() == scales.sizes(),
                "float32 [n, k / 32] mins");
  const torch::Tensor sc = scales.contiguous(), q = quants.contiguous();
  const torch::Tensor mn = with_min ? mins->contiguous() : sc;
  const float* sp = sc.data_ptr<float>();
  const float* mp = mn.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  return pack_panels(n, nblocks, kind, quants.options(), [&](uint8_t* dst, int64_t row, int64_t b,
                                                               int64_t c) {
    float* d = reinterpret_cast<float*>(dst);
    uint8_t* qs = dst + quants_offset(kind);
    d[c] = sp[(row * nblocks + b) * per_block];
    if (kind == kQ8_0h) d[kNR + c] = sp[(row * nblocks + b) * 2 + 1];
    if (with_min) d[kNR + c] = mp[row * nblocks + b];
    const uint8_t* src = qp + row * k + b * kBlock;
    if (kind == kQ4_1) {
      for (int64_t j = 0; j < 16; ++j)
        qs[j * kNR + c] = static_cast<uint8_t>((src[j] & 0x0F) | (src[j + 16] << 4));
    } else {
      for (int64_t j = 0; j < kBlock; ++j) qs[j * kNR + c] = src[j];
    }
  });
}

torch::Tensor gguf_linear_int8(const torch::Tensor& x, const torch::Tensor& packed,
                               const std::string& layout, int64_t n,
                               const c10::optional<torch::Tensor>& bias);  // quant_int8.cpp

// `name` without `suffix` where it ends so (and holds more), else "".
std::string strip_suffix(const std::string& name, const std::string& suffix) {
  const bool ends = name.size() > suffix.size() &&
                    name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  return ends ? name.substr(0, name.size() - suffix.size()) : "";
}

// The layout of an integer-path type "<layout>+q8", or "" for any other type.
std::string q8_layout(const std::string& type) { return strip_suffix(type, "+q8"); }

// type: a layout, or "<layout>+q8" for the integer path (weights from pack_q8_layout).
torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const std::string& type, int64_t n, const c10::optional<torch::Tensor>& bias) {
  const std::string layout = q8_layout(type);
  if (!layout.empty()) return gguf_linear_int8(x, packed, layout, n, bias);
  const int kind = kind_of(type);
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "x has ", k, " columns, not a multiple of 32");
  const int64_t panels = (n + kNR - 1) / kNR;
  TORCH_CHECK(packed.numel() == panels * (k / kBlock) * packed_block_bytes(kind),
              "packed weights are not ", n, " x ", k, " of ", type, " from pack_gguf_weight");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "float32 or bfloat16 x");
  const bool bf16 = dtype == torch::kBFloat16;
  torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty({m, n}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (m > 0) {
    if (kind == kQ4_1) {
      if (bf16) run<kQ4_1>(xf.data_ptr<float>(), m, k, w, n, true, out.data_ptr<at::BFloat16>());
      else run<kQ4_1>(xf.data_ptr<float>(), m, k, w, n, false, out.data_ptr<float>());
    } else if (kind == kQ8_0) {
      if (bf16) run<kQ8_0>(xf.data_ptr<float>(), m, k, w, n, true, out.data_ptr<at::BFloat16>());
      else run<kQ8_0>(xf.data_ptr<float>(), m, k, w, n, false, out.data_ptr<float>());
    } else if (kind == kQ8_0m) {
      if (bf16) run<kQ8_0m>(xf.data_ptr<float>(), m, k, w, n, true, out.data_ptr<at::BFloat16>());
      else run<kQ8_0m>(xf.data_ptr<float>(), m, k, w, n, false, out.data_ptr<float>());
    } else {
      if (bf16) run<kQ8_0h>(xf.data_ptr<float>(), m, k, w, n, true, out.data_ptr<at::BFloat16>());
      else run<kQ8_0h>(xf.data_ptr<float>(), m, k, w, n, false, out.data_ptr<float>());
    }
  }
  if (bias.has_value()) out.add_(*bias);
  return out;
}

void register_quant_linear(pybind11::module& m) {
  m.def("pack_gguf_weight", &pack_gguf_weight,
        "a GGUF tensor's rows of Q4_0, Q4_1 or Q8_0 blocks in the panel layout gguf_linear "
        "streams");
  m.def("pack_gguf_parts", &pack_gguf_parts,
        "decoded blocks (float32 d and m per 32 weights, a quant per weight) in the panel "
        "layout Q4_1, Q8_0, Q8_0m or Q8_0h that gguf_linear streams");
  m.def("gguf_linear", &gguf_linear,
        "x @ w.T (+ bias) over packed GGUF blocks, expanded in registers (rounded to bfloat16 "
        "for a bfloat16 x)");
}
