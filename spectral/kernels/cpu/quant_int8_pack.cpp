// The integer path's packers: weights packed by quant_linear.cpp (pack_gguf_weight,
// pack_gguf_parts) regrouped, and the parts of Q4_K, Q6_K, Q5_0 and Q5_1 blocks packed, in the
// layouts of quant_int8_layout.h. Each refuses what the tiles' sums could not hold exactly.
#include <atomic>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "quant_int8_layout.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

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

#pragma GCC pop_options
