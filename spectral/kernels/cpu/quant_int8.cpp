// The integer path over GGUF blocks (`--quantization gguf-int8`), its entry points: x quantized
// to 8 bits per block of 32, or per superblock of 256 for the K-quant tiles (quant_int8_tiles.cpp,
// quant_int8_k_tiles.cpp), and multiplied by weights packed in the layouts of
// quant_int8_layout.h (quant_int8_pack.cpp) through the integer tiles.
#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// x @ w.T (+ bias) with x quantized to 8 bits per block of 32 (quantize_q8's q, d, s) over
// weights regrouped by pack_q8_layout; float32 out, or bfloat16.
torch::Tensor gguf_linear_q8(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& s,
                             const torch::Tensor& packed, const std::string& layout, int64_t n,
                             const c10::optional<torch::Tensor>& bias, bool bf16_out,
                             const c10::optional<torch::Tensor>& shift) {
  const int kind = q8_kind_of(layout);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(),
              "q must be contiguous int8 [m, k]");
  const int64_t m = q.size(0), k = q.size(1), nb = k / kBlock;
  TORCH_CHECK(k % kBlock == 0 && d.scalar_type() == torch::kFloat32 && d.is_contiguous() &&
                  d.numel() == m * nb && s.scalar_type() == torch::kInt32 &&
                  s.is_contiguous() && s.numel() == m * nb,
              "d and s must be contiguous float32 and int32 [m, k / 32] (quantize_q8)");
  const int64_t panels = (n + kNR - 1) / kNR;
  const bool k_quant = per_superblock(kind);
  TORCH_CHECK(!k_quant || nb % 8 == 0, layout, " rows are whole superblocks of 256");
  if (k_quant) {
    TORCH_CHECK(shift.has_value() && shift->scalar_type() == torch::kInt8 &&
                    shift->is_contiguous() && shift->numel() == m * nb,
                layout, " takes x quantized per superblock of 256 with its blocks' shifts "
                "(quantize_q8(x, true))");
    const float* dp = d.data_ptr<float>();
    const int8_t* sp = shift->data_ptr<int8_t>();
    for (int64_t i = 0; i < m * nb; ++i)
      TORCH_CHECK((dp[i] == dp[i - i % 8] || std::isnan(dp[i])) && sp[i] >= 0 &&
                      sp[i] <= kMaxFiner,
                  layout, " takes x quantized per superblock of 256 (quantize_q8(x, true))");
  }
  TORCH_CHECK(packed.numel() == panels * q8_panel_bytes(kind, nb), "packed weights are not ", n,
              " x ", k, " of ", layout, " from pack_q8_layout or pack_q4_k_q8");
  // Q6_K's vector tiles take its quants unsigned and 32 x off after (the scalar loops need
  // none of it: they subtract 32 from each quant).
  std::vector<int32_t> q6_bias(kind == kQ6_K ? m * k / 16 : 0);
  if (kind == kQ6_K) q6_biases(q.data_ptr<int8_t>(), m, k, q6_bias.data());
  const int8_t* shifts = k_quant ? shift->data_ptr<int8_t>() : nullptr;
  std::vector<int32_t> pairs(kind == kQ4_K ? m * nb / 2 : 0);  // Q4_K's minimums, two a time
  if (kind == kQ4_K) s_pairs(s.data_ptr<int32_t>(), shifts, m * nb, pairs.data());
  const Q8Rows x{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), k,
                 shifts, q6_bias.data(), pairs.data()};
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

// The blocks' shifts among quantize_q8's outputs, where it quantized per superblock.
c10::optional<torch::Tensor> shift_of(const std::vector<torch::Tensor>& quantized) {
  if (quantized.size() < 4) return c10::nullopt;
  return quantized[3];
}

// Whether the integer-path layout's tile takes x quantized per superblock of 256.
bool takes_superblocks(const std::string& layout) { return per_superblock(q8_kind_of(layout)); }

// gguf_linear for a layout named "<layout>+q8": x quantized here, then gguf_linear_q8.
torch::Tensor gguf_linear_int8(const torch::Tensor& x, const torch::Tensor& packed,
                               const std::string& layout, int64_t n,
                               const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "float32 or bfloat16 x");
  const std::vector<torch::Tensor> q = quantize_q8(x, takes_superblocks(layout));
  return gguf_linear_q8(q[0], q[1], q[2], packed, layout, n, bias,
                        x.scalar_type() == torch::kBFloat16, shift_of(q));
}

// x @ w.T (+ bias) for a weight in parts stacked by rows (packed for gguf_linear, or dense with
// kind ""), their outputs side by side; x is quantized once for all the integer-path parts
// (once per block of 32 and once per superblock where both kinds of tile are among them).
torch::Tensor linear_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& data,
                           const std::vector<std::string>& kinds, const std::vector<int64_t>& ns,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!data.empty() && data.size() == kinds.size() && data.size() == ns.size(),
              "one kind and one row count per part");
  auto is_q8 = [](const std::string& kind) { return !q8_layout(kind).empty(); };
  // x quantized once for the parts whose tiles take it per block of 32, once for those taking
  // it per superblock of 256 (the K-quant tiles)
  std::vector<torch::Tensor> quantized[2];
  for (const std::string& kind : kinds) {
    if (!is_q8(kind)) continue;
    const bool superblocks = takes_superblocks(q8_layout(kind));
    if (quantized[superblocks].empty()) quantized[superblocks] = quantize_q8(x, superblocks);
  }
  const c10::optional<torch::Tensor> none;
  std::vector<torch::Tensor> outs;
  for (size_t i = 0; i < data.size(); ++i) {
    const std::string& kind = kinds[i];
    if (is_q8(kind)) {
      const std::vector<torch::Tensor>& xq = quantized[takes_superblocks(q8_layout(kind))];
      outs.push_back(gguf_linear_q8(xq[0], xq[1], xq[2], data[i], q8_layout(kind), ns[i], none,
                                    x.scalar_type() == torch::kBFloat16, shift_of(xq)));
    }
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
        "rows quantized per block of 32 to 8 bits: (q int8, d float32, s = sum q int32); with "
        "superblocks, per 256 inputs (the K-quant tiles' input), and each block's shift",
        pybind11::arg("x"), pybind11::arg("superblocks") = false);
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
        "x @ w.T (+ bias) from x quantized by quantize_q8, in integer dot products per block "
        "(the K-quant layouts: x per superblock, with its blocks' shifts)",
        pybind11::arg("q"), pybind11::arg("d"), pybind11::arg("s"), pybind11::arg("packed"),
        pybind11::arg("layout"), pybind11::arg("n"), pybind11::arg("bias"),
        pybind11::arg("bf16_out"), pybind11::arg("shift") = c10::nullopt);
}
