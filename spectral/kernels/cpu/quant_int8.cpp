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

namespace {

// x's rows quantized, and what the tiles read beside them, in buffers the calling thread keeps
// from call to call: a decode step's linears would otherwise allocate six each. Two sets of
// rows, as a weight in parts may take x quantized both per block of 32 and per superblock.
struct Q8Buffers {
  std::vector<int8_t> q, shift;
  std::vector<float> d;
  std::vector<int32_t> s;
};
struct TileExtras {
  std::vector<int32_t> starts, pairs;
};
// Buffers grown past this many bytes (a long prefill's) are let go after the call.
constexpr size_t kKeptBytes = size_t{1} << 20;

// v's storage for at least n elements: grown, never shrunk, so that calls of alternating sizes
// (a layer's linears) do not zero their buffers' new parts again and again.
template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(n);
  return v.data();
}

Q8Buffers& q8_buffers(bool superblocks) {
  thread_local Q8Buffers kept[2];
  return kept[superblocks];
}

TileExtras& tile_extras() {
  thread_local TileExtras kept;
  return kept;
}

void release_large_buffers() {
  for (bool superblocks : {false, true}) {
    Q8Buffers& b = q8_buffers(superblocks);
    if (b.q.capacity() > kKeptBytes) b = Q8Buffers{};
  }
  if (tile_extras().starts.capacity() * sizeof(int32_t) > kKeptBytes) tile_extras() = TileExtras{};
}

// The Q8Rows of x quantized (q, d, s, shift) for the tile of `kind`: Q6_K's vector tiles take
// its quants unsigned and their sums begun at minus 32 x (q6_starts; the scalar loops need none
// of it: they subtract 32 from each quant), Q4_K's take the minimums' sums two blocks at a time
// (s_pairs), both made into `extra`'s buffers.
Q8Rows q8_rows(int kind, const int8_t* q, const float* d, const int32_t* s, const int8_t* shift,
               int64_t m, int64_t k, TileExtras& extra) {
  const int64_t nb = k / kBlock;
  Q8Rows rows{q, d, s, k, shift};
#if defined(SPECTRAL_VEC)
  if (kind == kQ6_K) {
    int32_t* starts = at_least(extra.starts, m * k / 16);
    q6_starts(q, m, k, starts);
    rows.q6_start = starts;
  }
#endif
  if (kind == kQ4_K) {
    int32_t* pairs = at_least(extra.pairs, m * nb / 2);
    s_pairs(s, shift, m * nb, pairs);
    rows.s_pairs = pairs;
  }
  return rows;
}

// x quantized into `b` (per superblock of 256 with each block's shift, or per block of 32).
Q8Rows quantize_into(const torch::Tensor& x, bool superblocks, Q8Buffers& b) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "float32 or bfloat16 x");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % (superblocks ? 256 : kBlock) == 0, "x has ", k, " columns, not a multiple of ",
              superblocks ? 256 : kBlock);
  const torch::Tensor xf = x.scalar_type() == torch::kFloat32 && x.is_contiguous()
                               ? x
                               : x.to(torch::kFloat32).contiguous();
  int8_t* q = at_least(b.q, m * k);
  float* d = at_least(b.d, m * k / kBlock);
  int32_t* s = at_least(b.s, m * k / kBlock);
  int8_t* shift = superblocks ? at_least(b.shift, m * k / kBlock) : nullptr;
  quantize_rows(xf.data_ptr<float>(), m, k, q, d, s, shift);
  return Q8Rows{q, d, s, k, shift};
}

// out[r * ld + c] (r < m, c < n) = row r of x @ w.T through the tile of `kind`.
template <typename O>
void run_kind(int kind, const Q8Rows& x, int64_t m, const uint8_t* w, int64_t n, O* out,
              int64_t ld) {
  if (m == 0) return;
  auto go = [&](auto kind_tag) {
    constexpr int K = decltype(kind_tag)::value;
    run_q8<K>(x, m, w, n, out, ld);
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

// Columns [col, col + n) of out [m, N] (float32 or bfloat16): x @ w.T for a weight of `layout`
// packed for the integer tiles, x as `rows` holds it quantized.
void q8_linear_into(const Q8Rows& rows, int64_t m, const torch::Tensor& packed,
                    const std::string& layout, int64_t n, torch::Tensor& out, int64_t col) {
  const int kind = q8_kind_of(layout);
  const int64_t panels = (n + kNR - 1) / kNR, nb = rows.k / kBlock;
  TORCH_CHECK(packed.numel() == panels * q8_panel_bytes(kind, nb), "packed weights are not ", n,
              " x ", rows.k, " of ", layout, " from pack_q8_layout or pack_q4_k_q8");
  TORCH_CHECK(!per_superblock(kind) || rows.shift != nullptr, layout,
              " takes x quantized per superblock of 256 (quantize_q8(x, true))");
  const Q8Rows x = q8_rows(kind, rows.q, rows.d, rows.s, rows.shift, m, rows.k, tile_extras());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t ld = out.size(1);
  if (out.scalar_type() == torch::kBFloat16)
    run_kind(kind, x, m, w, n, out.data_ptr<at::BFloat16>() + col, ld);
  else run_kind(kind, x, m, w, n, out.data_ptr<float>() + col, ld);
}

}  // namespace

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
  const Q8Rows rows{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), k,
                    k_quant ? shift->data_ptr<int8_t>() : nullptr};
  torch::Tensor out =
      torch::empty({m, n}, q.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  q8_linear_into(rows, m, packed, layout, n, out, 0);
  release_large_buffers();
  if (bias.has_value()) out.add_(*bias);
  return out;
}

// Whether the integer-path layout's tile takes x quantized per superblock of 256.
bool takes_superblocks(const std::string& layout) { return per_superblock(q8_kind_of(layout)); }

// gguf_linear for a layout named "<layout>+q8": x quantized here (into the thread's kept
// buffers), then the tiles.
torch::Tensor gguf_linear_int8(const torch::Tensor& x, const torch::Tensor& packed,
                               const std::string& layout, int64_t n,
                               const c10::optional<torch::Tensor>& bias) {
  const bool superblocks = takes_superblocks(layout);
  const Q8Rows rows = quantize_into(x, superblocks, q8_buffers(superblocks));
  torch::Tensor out = torch::empty({x.size(0), n}, x.options());
  q8_linear_into(rows, x.size(0), packed, layout, n, out, 0);
  release_large_buffers();
  if (bias.has_value()) out.add_(*bias);
  return out;
}

// x @ w.T (+ bias) for a weight in parts stacked by rows (packed for gguf_linear, or dense with
// kind ""), their outputs side by side; x is quantized once for all the integer-path parts
// (once per block of 32 and once per superblock where both kinds of tile are among them), and
// each of them writes its columns of the output in place.
torch::Tensor linear_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& data,
                           const std::vector<std::string>& kinds, const std::vector<int64_t>& ns,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(!data.empty() && data.size() == kinds.size() && data.size() == ns.size(),
              "one kind and one row count per part");
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  int64_t total = 0;
  for (int64_t n : ns) total += n;
  torch::Tensor out = torch::empty({x.size(0), total}, x.options());
  Q8Rows quantized[2];
  bool done[2] = {false, false};
  int64_t col = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    const std::string layout = q8_layout(kinds[i]);
    if (!layout.empty()) {
      const bool superblocks = takes_superblocks(layout);
      if (!done[superblocks]) {
        quantized[superblocks] = quantize_into(x, superblocks, q8_buffers(superblocks));
        done[superblocks] = true;
      }
      q8_linear_into(quantized[superblocks], x.size(0), data[i], layout, ns[i], out, col);
    } else {
      const c10::optional<torch::Tensor> none;
      out.narrow(1, col, ns[i]).copy_(kinds[i].empty() ? packed_linear(x, data[i], ns[i], none)
                                                        : gguf_linear(x, data[i], kinds[i], ns[i], none));
    }
    col += ns[i];
  }
  release_large_buffers();
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
