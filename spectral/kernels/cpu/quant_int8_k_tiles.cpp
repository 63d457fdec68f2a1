// The integer path's K-quant tiles (Q4_K and Q6_K in their compact layouts), x quantized per
// superblock of 256 inputs (quantize_rows with shifts: the superblock's d, each block on that
// step / 2^(3 - shift_b)). A block's integer sums times its integer scales, times 2^shift_b, add
// up in int32 over the superblock, and combine in float32 once a superblock, each operation
// rounded once:
//
//   Q4_K: u = d * I + (-dmin) * M,  I = sum_b 2^shift_b scale_b isum_b,  M = sum_b 2^shift_b min_b s_b
//   Q6_K: u = d * I,                I = sum_b 2^shift_b sum_half scale_{b,half} isum_{b,half}
//   acc = acc + (dx * 2^-3) * u
//
// (I at most 8 * 8 * 63 * 32 * 15 * 127 for Q4_K, 16 * 8 * 128 * 16 * 32 * 127 for Q6_K: int32
// holds both). Per block of 32 the other layouts' tiles (quant_int8_tiles.cpp) round seven float
// operations a row and column; these, under one a block. tests/test_gguf_int8.py holds every
// build to a NumPy reference of this arithmetic. Then the tiles' dispatch and entry point.
#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_dot.h"
#include "quant_int8_layout.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

// The superblock's step times this is its blocks' finest (quantize_rows).
constexpr float kFinestStep = 1.f / (1 << kMaxFiner);

#if defined(SPECTRAL_VEC)
// Where rows row0.. of x begin in each of its arrays that a K-quant tile reads block by block:
// found once a tile, not once a block (a row's offsets, 16 scalar instructions each, ran beside
// every block's 128 multiply-adds).
template <int R>
struct RowStarts {
  const int8_t* q[R];
  const int8_t* shift[R];
  const int32_t* q6_start[R];
  RowStarts(const Q8Rows& x, int64_t row0) {
    for (int r = 0; r < R; ++r) {
      q[r] = x.q + (row0 + r) * x.k;
      shift[r] = x.shift + (row0 + r) * (x.k / kBlock);
      q6_start[r] = x.q6_start ? x.q6_start + (row0 + r) * (x.k / 16) : nullptr;
    }
  }
};

// Q6_K's quants u = q + 32 (0..63) of block qw, group g (4 inputs) of half `half` (the first 16
// inputs, low nibbles, or the last 16, high nibbles), columns kIntLanes v..: rebuilt from the
// nibbles and the high bits, taken unsigned. Inlined where g and half are constants (unrolled
// loops), so that the shifts are too.
inline IVec q6_quants(const uint8_t* qw, int half, int g, int v) {
  const IVec mask = iv::bytes(0x0F), high_bits = iv::bytes(0x30);
  const int bit = (g / 2) * 4 + half * 2;  // where the group's high bits are, put at 4
  const IVec w = group_vec(qw, g, v);
  const IVec h = iv::load(qw + 16 * kNR + (g % 2) * kNR * 4 + v * kVecBytes);
  const IVec low = iv::and_(half ? iv::srl16(w, 4) : w, mask);
  const IVec high = bit < 4 ? iv::sll16(h, 4 - bit) : bit > 4 ? iv::srl16(h, bit - 4) : h;
  return iv::or_(low, iv::and_(high, high_bits));
}

// The int8 scales of half `half` of a Q6_K block, in both int16 halves of each column's lane.
inline void q6_scales(const uint8_t* blk, int half, IVec (&scale)[kV]) {
  for (int v = 0; v < kV; ++v)
    scale[v] = iv::both_halves(iv::i8_lanes(blk + half * kNR + kIntLanes * v));
}

// The products of one half of a Q6_K block (its quants u, 16 inputs) with rows R0..R0 + G of x,
// begun at minus 32 x (q6_starts): the sums of q itself (at most 8 * 32 * 127 a lane) fit int16,
// those of u, a maddubs pair at most 2 * 63 * 127, wrap there on the way but come out exact.
template <int R0, int G, int R>
struct Q6HalfSums {
  DotSum acc[G][kV];
  const int8_t* const* xq;
  int half;

  Q6HalfSums(const RowStarts<R>& rows, const int8_t* const* xq_, int64_t b, int half_)
      : xq(xq_), half(half_) {
    for (int r = 0; r < G; ++r) {
      const DotSum start = DotSum::starting_at(rows.q6_start[R0 + r] + 2 * b + half);
      for (int v = 0; v < kV; ++v) acc[r][v] = start;
    }
  }
  // + group g's products (u: its quants)
  void add(const IVec (&u)[kV], int g) {
    for (int r = 0; r < G; ++r) {
      const IVec xg = bcast4(xq[R0 + r] + 16 * half + 4 * g);
      for (int v = 0; v < kV; ++v) {
        acc[r][v].add(u[v], xg);
        settle(acc[r][v]);
      }
    }
  }
  // sums + these times the half's scales and 2^shift of each row's block
  void scale_into(const IVec (&scale)[kV], const __m128i* shift, IVec (&sums)[R][kV]) const {
    for (int r = 0; r < G; ++r)
      for (int v = 0; v < kV; ++v)
        sums[R0 + r][v] = iv::add32(sums[R0 + r][v],
                                    iv::sll32(acc[r][v].widen_scaled(scale[v]), shift[R0 + r]));
  }
  // sums + rows R0..R0 + G's products with a half's quants u (all four groups), scaled
  static void over(const IVec (&u)[4][kV], const RowStarts<R>& rows, const int8_t* const* xq,
                   int64_t b, int half, const IVec (&scale)[kV], const __m128i* shift,
                   IVec (&sums)[R][kV]) {
    Q6HalfSums part(rows, xq, b, half);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) part.add(u[g], g);
    part.scale_into(scale, shift, sums);
  }
};

// Q6_K's scaled_block_sums (qw: the block's quants), half after half, each group's quants
// rebuilt as its products are taken; at 8 rows in two groups of 4 rows over the half's quants
// rebuilt once (with every row's sums live beside the half's, the registers ran out and the
// tile spilled: 0.96x the rate of these on an AMD EPYC, in cache). The loops are unrolled, so
// that each group's shifts are constants (the compiler leaves them be).
template <int R>
inline void q6_block_sums(const uint8_t* blk, const uint8_t* qw, const RowStarts<R>& rows,
                          int64_t b, const int8_t* const* xq, const __m128i* shift,
                          IVec (&sums)[R][kV]) {
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    IVec scale[kV];
    if constexpr (R == 8) {
      q6_scales(blk, half, scale);
      IVec u[4][kV];
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g)
        for (int v = 0; v < kV; ++v) u[g][v] = q6_quants(qw, half, g, v);
      Q6HalfSums<0, 4, R>::over(u, rows, xq, b, half, scale, shift, sums);
      Q6HalfSums<4, R - 4, R>::over(u, rows, xq, b, half, scale, shift, sums);
    } else {
      Q6HalfSums<0, R, R> part(rows, xq, b, half);
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        IVec u[kV];
        for (int v = 0; v < kV; ++v) u[v] = q6_quants(qw, half, g, v);
        part.add(u, g);
      }
      q6_scales(blk, half, scale);
      part.scale_into(scale, shift, sums);
    }
  }
}

// sums[r][v] + block b's integer sums of rows r with columns kIntLanes v.., each times its scale
// (Q4_K: a block's 6-bit scale; Q6_K: each half's int8 scale) and 2^shift of the row's block.
template <int Kind, int R>
inline void scaled_block_sums(const uint8_t* blk, const RowStarts<R>& rows, int64_t b,
                              IVec (&sums)[R][kV]) {
  const uint8_t* qw = blk + q8_quants_offset(Kind);
  const int8_t* xq[R];
  __m128i shift[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = rows.q[r] + b * kBlock;
    shift[r] = _mm_cvtsi32_si128(rows.shift[r][b]);
  }
  if constexpr (Kind == kQ4_K) {
    DotSum acc[R][kV];
    nibble_sums<R>(qw, xq, acc);
    for (int v = 0; v < kV; ++v) {
      const IVec scale = iv::both_halves(iv::u8_lanes(blk + kIntLanes * v));
      for (int r = 0; r < R; ++r)
        sums[r][v] = iv::add32(sums[r][v], iv::sll32(acc[r][v].widen_scaled(scale), shift[r]));
    }
  } else {
    q6_block_sums<R>(blk, qw, rows, b, xq, shift, sums);
  }
}

// mins[r][v]: sum over superblock sb's 8 blocks of each column's minimum times row r's block sum
// of x times 2^shift (s_pairs), two blocks a multiply-add (the minimums of blocks 2i and 2i + 1
// side by side as int16).
template <int R>
inline void q4_k_min_sums(const uint8_t* blocks, const Q8Rows& x, int64_t row0, int64_t sb,
                          IVec (&mins)[R][kV]) {
  const int64_t pairs = x.k / (2 * kBlock);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) mins[r][v] = iv::zero();
  for (int i = 0; i < 4; ++i) {
    const uint8_t* first = blocks + (8 * sb + 2 * i) * q8_block_bytes(kQ4_K) + kNR;
    const uint8_t* second = first + q8_block_bytes(kQ4_K);
    IVec both[kV];
    for (int v = 0; v < kV; ++v)
      both[v] = iv::u8_pair_lanes(first + kIntLanes * v, second + kIntLanes * v);
    for (int r = 0; r < R; ++r) {
      const IVec s = iv::words(x.s_pairs[(row0 + r) * pairs + 4 * sb + i]);
      for (int v = 0; v < kV; ++v) mins[r][v] = iv::add32(mins[r][v], iv::madd16(both[v], s));
    }
  }
}

// out[R][kNR]: rows row0.. of x over one panel of a K-quant layout, superblock after superblock
// (the float sums kept in out: at 8 rows they would not fit the registers beside the integer
// ones).
template <int Kind, int R>
void k_tile(const Q8Rows& x, int64_t row0, const uint8_t* panel, float* out) {
  const int64_t nb = x.k / kBlock;
  const int64_t header = q8_header_bytes(Kind, nb) / (nb / 8);  // a superblock's d (and -dmin)
  const RowStarts<R> rows(x, row0);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) iv::fstore(out + r * kNR + kIntLanes * v, iv::fzero());
  const uint8_t* blocks = panel + q8_header_bytes(Kind, nb);
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    IVec sums[R][kV], mins[R][kV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kV; ++v) sums[r][v] = iv::zero();
    for (int64_t b = 8 * sb; b < 8 * sb + 8; ++b) {
      const uint8_t* blk = blocks + b * q8_block_bytes(Kind);
      prefetch_for_rows<R>(blk, q8_block_bytes(Kind));
      scaled_block_sums<Kind, R>(blk, rows, b, sums);
    }
    if constexpr (Kind == kQ4_K) q4_k_min_sums<R>(blocks, x, row0, sb, mins);
    const float* d = reinterpret_cast<const float*>(panel + sb * header);
    for (int r = 0; r < R; ++r) {
      const FVec dx = iv::fset1(x.d[(row0 + r) * nb + 8 * sb] * kFinestStep);
      for (int v = 0; v < kV; ++v) {
        FVec u = iv::fmul(iv::fload(d + kIntLanes * v), iv::to_float(sums[r][v]));
        if constexpr (Kind == kQ4_K)
          u = iv::fadd(u, iv::fmul(iv::fload(d + kNR + kIntLanes * v), iv::to_float(mins[r][v])));
        float* o = out + r * kNR + kIntLanes * v;
        iv::fstore(o, iv::fadd(iv::fload(o), iv::fmul(dx, u)));
      }
    }
  }
}
#else
// out[R][kNR]: rows row0.. of x over one panel of a K-quant layout, superblock after superblock.
template <int Kind, int R>
void k_tile(const Q8Rows& x, int64_t row0, const uint8_t* panel, float* out) {
  const int64_t nb = x.k / kBlock;
  const int64_t header = q8_header_bytes(Kind, nb) / (nb / 8);
  alignas(64) float acc[R][kNR] = {};
  alignas(64) int32_t isum[R][2 * kNR];
  const uint8_t* blocks = panel + q8_header_bytes(Kind, nb);
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    int32_t sums[R][kNR] = {}, mins[R][kNR] = {};
    for (int64_t b = 8 * sb; b < 8 * sb + 8; ++b) {
      const uint8_t* blk = blocks + b * q8_block_bytes(Kind);
      block_sums<Kind, R>(blk + q8_quants_offset(Kind), x, row0, b, isum);
      for (int r = 0; r < R; ++r) {
        const int32_t times = 1 << x.shift[(row0 + r) * nb + b];
        for (int64_t c = 0; c < kNR; ++c) {
          if constexpr (Kind == kQ4_K) {
            sums[r][c] += blk[c] * isum[r][c] * times;
            mins[r][c] += blk[kNR + c] * x.s[(row0 + r) * nb + b] * times;
          } else {
            sums[r][c] += (static_cast<int8_t>(blk[c]) * isum[r][c] +
                           static_cast<int8_t>(blk[kNR + c]) * isum[r][kNR + c]) *
                          times;
          }
        }
      }
    }
    const float* d = reinterpret_cast<const float*>(panel + sb * header);
    for (int r = 0; r < R; ++r) {
      const float dx = x.d[(row0 + r) * nb + 8 * sb] * kFinestStep;
      for (int64_t c = 0; c < kNR; ++c) {
        float u = d[c] * static_cast<float>(sums[r][c]);
        if constexpr (Kind == kQ4_K) u = u + d[kNR + c] * static_cast<float>(mins[r][c]);
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
  if constexpr (per_superblock(Kind)) k_tile<Kind, R>(x, row0, panel, out);
  else q8_tile<Kind, R>(x, row0, panel, out);
}

// out[r * ld + c] for rows r < m and columns c < n of x @ w.T.
template <int Kind, typename O>
void run_q8(const Q8Rows& x, int64_t m, const uint8_t* packed, int64_t n, O* out, int64_t ld) {
  const int64_t panels = (n + kNR - 1) / kNR;
  const int64_t panel_bytes = q8_panel_bytes(Kind, x.k / kBlock);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float buf[kQ8Rows * kNR];
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t r0 = 0; r0 < m; r0 += kQ8Rows) {
        const int rows = static_cast<int>(std::min<int64_t>(kQ8Rows, m - r0));
        q8_tile_rows<Kind>(rows, x, r0, packed + p * panel_bytes, buf);
        store_tile(buf, rows, r0, n, p * kNR, out, ld);
      }
    }
  });
}

}  // namespace

// x [m, k] float32 or bfloat16 -> (q int8 [m, k], d float32 [m, k / 32], s int32 [m, k / 32]);
// with `superblocks`, per superblock of 256 inputs (what the K-quant tiles take), and a fourth,
// each block's shift int8 [m, k / 32] (quantize_rows).
std::vector<torch::Tensor> quantize_q8(const torch::Tensor& x, bool superblocks) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % (superblocks ? 256 : kBlock) == 0, "x has ", k, " columns, not a multiple of ",
              superblocks ? 256 : kBlock);
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor q = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  torch::Tensor d = torch::empty({m, k / kBlock}, x.options().dtype(torch::kFloat32));
  torch::Tensor s = torch::empty({m, k / kBlock}, x.options().dtype(torch::kInt32));
  torch::Tensor shift = torch::empty({superblocks ? m : 0, k / kBlock}, q.options());
  quantize_rows(xf.data_ptr<float>(), m, k, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                s.data_ptr<int32_t>(), superblocks ? shift.data_ptr<int8_t>() : nullptr);
  if (superblocks) return {q, d, s, shift};
  return {q, d, s};
}

#pragma GCC pop_options
