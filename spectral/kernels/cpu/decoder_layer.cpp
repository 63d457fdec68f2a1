// One whole Llama decoder layer in a single call, for the steps whose attention runs through
// decode_attention (decode steps, tree verification, prefill on the CPU): the same kernels, in
// the same order, as LlamaDecoderLayer.forward over the CPU kernels, without a trip through
// Python and torch's dispatcher between them (about 10 us each on a small CPU, some 25 a layer).
//
//   residual, h = add_rms_norm(x, residual)        (residual += x, in place)
//   qkv = h @ Wqkv;  rotary on q and k, in place;  k, v written to their KV slots
//   attn = decode_attention(q, pool)                (each row over its kv_indices)
//   residual, h = add_rms_norm(attn @ Wo, residual)
//   return silu_mul(h @ Wgate_up) @ Wdown, residual  (silu(gate) * up of gate | up)
#include <ATen/ATen.h>
#include <torch/python.h>

#include <cstring>
#include <string>
#include <vector>

torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const std::string& type, int64_t n,
                          const c10::optional<torch::Tensor>& bias);
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias);
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                        const c10::optional<torch::Tensor>& residual,
                                        const torch::Tensor& weight, double eps);
void rotary_inplace(torch::Tensor& x, int64_t heads, int64_t dim, const torch::Tensor& cos,
                    const torch::Tensor& sin, const torch::Tensor& positions);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_buf,
                               const torch::Tensor& v_buf, const torch::Tensor& kv_indices,
                               const torch::Tensor& seq_lens, double scale,
                               const c10::optional<torch::Tensor>& extend_lens);

torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor linear_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& data,
                           const std::vector<std::string>& kinds, const std::vector<int64_t>& ns,
                           const c10::optional<torch::Tensor>& bias);  // quant_int8.cpp

namespace {

// A weight packed for the matmul kernels: GGUF blocks of `kind`, or dense ("" kind); or such
// parts stacked by rows (a fused weight whose tensors need different layouts).
struct PackedLinear {
  std::vector<torch::Tensor> data;
  std::vector<std::string> kinds;
  std::vector<int64_t> ns;
  c10::optional<torch::Tensor> bias;

  PackedLinear(torch::Tensor d, std::string kind, int64_t n, c10::optional<torch::Tensor> b)
      : data{std::move(d)}, kinds{std::move(kind)}, ns{n}, bias(std::move(b)) {}
  PackedLinear(std::vector<torch::Tensor> d, std::vector<std::string> k, std::vector<int64_t> n,
               c10::optional<torch::Tensor> b)
      : data(std::move(d)), kinds(std::move(k)), ns(std::move(n)), bias(std::move(b)) {}

  // Asks for the weights to be brought into the caches (L2 and below) ahead of their matmul,
  // for a window where the memory bus has little else to do (attention reads a few rows).
  void prefetch() const {
    for (const torch::Tensor& d : data) {
      const char* p = static_cast<const char*>(d.data_ptr());
      const int64_t bytes = d.numel() * d.element_size();
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
    }
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (data.size() > 1) return linear_parts(x, data, kinds, ns, bias);
    return kinds[0].empty() ? packed_linear(x, data[0], ns[0], bias)
                            : gguf_linear(x, data[0], kinds[0], ns[0], bias);
  }
};

// Steps of at most this many tokens fetch the output projection while attention runs (a
// longer step's attention reads enough keys to keep the bus busy).
constexpr int64_t kPrefetchTokens = 16;

struct DecoderLayer {
  torch::Tensor input_norm, post_norm;
  double eps;
  PackedLinear qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim, intermediate;

  std::vector<torch::Tensor> forward(const torch::Tensor& x,
                                     const c10::optional<torch::Tensor>& residual,
                                     const torch::Tensor& positions, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const torch::Tensor& k_buf,
                                     const torch::Tensor& v_buf, const torch::Tensor& out_loc,
                                     const torch::Tensor& kv_indices,
                                     const torch::Tensor& seq_lens, double scale,
                                     const c10::optional<torch::Tensor>& extend_lens) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [tokens, hidden]");
    TORCH_CHECK(k_buf.scalar_type() == x.scalar_type() && k_buf.is_contiguous() &&
                    v_buf.is_contiguous(),
                "the KV pool must be contiguous and of x's dtype");
    TORCH_CHECK(out_loc.scalar_type() == torch::kInt64 && out_loc.numel() == x.size(0),
                "one int64 KV slot per token");
    std::vector<torch::Tensor> normed = add_rms_norm(x, residual, input_norm, eps);
    torch::Tensor res = normed[1];
    torch::Tensor qkv_out = qkv(normed[0]);
    rotary_inplace(qkv_out, heads + kv_heads, head_dim, cos, sin, positions);
    write_kv(qkv_out, k_buf, v_buf, out_loc.contiguous());
    const int64_t tokens = x.size(0);
    if (tokens <= kPrefetchTokens) o.prefetch();
    torch::Tensor q = qkv_out.narrow(1, 0, heads * head_dim).view({tokens, heads, head_dim});
    torch::Tensor attn = decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, scale, extend_lens);
    normed = add_rms_norm(o(attn.view({tokens, heads * head_dim})), res, post_norm, eps);
    return {down(silu_mul(gate_up(normed[0]))), res};
  }

  // k and v of every token (after q in each row of qkv) into their slots of the pool.
  void write_kv(const torch::Tensor& qkv_out, const torch::Tensor& k_buf,
                const torch::Tensor& v_buf, const torch::Tensor& out_loc) const {
    const int64_t esize = qkv_out.element_size(), slots = k_buf.size(0);
    const int64_t bytes = kv_heads * head_dim * esize, q_bytes = heads * head_dim * esize;
    const auto* src = static_cast<const char*>(qkv_out.data_ptr());
    auto* kd = static_cast<char*>(k_buf.data_ptr());
    auto* vd = static_cast<char*>(v_buf.data_ptr());
    const int64_t* loc = out_loc.data_ptr<int64_t>();
    for (int64_t t = 0; t < qkv_out.size(0); ++t) {
      TORCH_CHECK(loc[t] >= 0 && loc[t] < slots, "KV slot ", loc[t], " is out of the pool");
      const char* row = src + t * qkv_out.stride(0) * esize;
      std::memcpy(kd + loc[t] * bytes, row + q_bytes, bytes);
      std::memcpy(vd + loc[t] * bytes, row + q_bytes + bytes, bytes);
    }
  }
};

// Every layer of a step in turn, in one call: what a Python loop over DecoderLayer.forward
// gives, without its interpreter and argument conversions between the layers (6% of the
// default model's decode step here). The KV pool is per layer (k_bufs[i], v_bufs[i]). Also
// the hidden state entering each layer of `capture` (ascending; n: the last layer's output),
// what an EAGLE-3 head reads.
struct DecoderStack {
  std::vector<DecoderLayer> layers;

  std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& positions,
                                     const torch::Tensor& cos, const torch::Tensor& sin,
                                     const std::vector<torch::Tensor>& k_bufs,
                                     const std::vector<torch::Tensor>& v_bufs,
                                     const torch::Tensor& out_loc,
                                     const torch::Tensor& kv_indices,
                                     const torch::Tensor& seq_lens, double scale,
                                     const c10::optional<torch::Tensor>& extend_lens,
                                     const std::vector<int64_t>& capture) const {
    const int64_t n = static_cast<int64_t>(layers.size());
    TORCH_CHECK(static_cast<int64_t>(k_bufs.size()) == n &&
                    static_cast<int64_t>(v_bufs.size()) == n,
                "one K and one V buffer per layer (", n, " layers, got ", k_bufs.size(),
                " and ", v_bufs.size(), ")");
    for (size_t c = 0; c < capture.size(); ++c)
      TORCH_CHECK(capture[c] >= 0 && capture[c] <= n && (c == 0 || capture[c] > capture[c - 1]),
                  "capture: ascending layer indices in [0, ", n, "]");
    std::vector<torch::Tensor> state{x, torch::Tensor()}, captured;
    auto next = capture.begin();
    for (int64_t i = 0; i <= n; ++i) {
      if (next != capture.end() && *next == i) {
        captured.push_back(i == 0 ? state[0].clone() : state[0] + state[1]);
        ++next;
      }
      if (i == n) break;
      c10::optional<torch::Tensor> residual;
      if (i > 0) residual = state[1];
      state = layers[i].forward(state[0], residual, positions, cos, sin, k_bufs[i], v_bufs[i],
                                out_loc, kv_indices, seq_lens, scale, extend_lens);
    }
    state.insert(state.end(), captured.begin(), captured.end());
    return state;
  }
};

}  // namespace

void register_decoder_layer(pybind11::module& m) {
  pybind11::class_<PackedLinear>(m, "PackedLinear")
      .def(pybind11::init<torch::Tensor, std::string, int64_t, c10::optional<torch::Tensor>>(),
           "a weight packed for gguf_linear (its layout as kind) or packed_linear (kind '')")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<std::string>,
                          std::vector<int64_t>, c10::optional<torch::Tensor>>(),
           "parts of a weight stacked by rows, each packed as above (linear_parts)");
  pybind11::class_<DecoderLayer>(m, "DecoderLayer")
      .def(pybind11::init<torch::Tensor, torch::Tensor, double, PackedLinear, PackedLinear,
                          PackedLinear, PackedLinear, int64_t, int64_t, int64_t, int64_t>(),
           "(input_norm, post_norm, eps, qkv, o, gate_up, down, heads, kv_heads, head_dim, "
           "intermediate)")
      .def("forward", &DecoderLayer::forward,
           "(x, residual, positions, cos, sin, k_buf, v_buf, out_loc, kv_indices, seq_lens, "
           "scale, extend_lens) -> [delta, residual]: the layer over decode_attention",
           pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("positions"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("k_buf"),
           pybind11::arg("v_buf"), pybind11::arg("out_loc"), pybind11::arg("kv_indices"),
           pybind11::arg("seq_lens"), pybind11::arg("scale"),
           pybind11::arg("extend_lens") = pybind11::none());
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init([](const std::vector<DecoderLayer>& layers) {
             TORCH_CHECK(!layers.empty(), "a stack needs at least one layer");
             return DecoderStack{layers};
           }),
           "(layers): DecoderLayer objects, run in this order")
      .def("forward", &DecoderStack::forward,
           "(x, positions, cos, sin, k_bufs, v_bufs, out_loc, kv_indices, seq_lens, scale, "
           "extend_lens, capture) -> [delta, residual, *captured]: every layer in turn, as "
           "DecoderLayer.forward from no residual, and the inputs of the `capture` layers",
           pybind11::arg("x"), pybind11::arg("positions"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("k_bufs"), pybind11::arg("v_bufs"),
           pybind11::arg("out_loc"), pybind11::arg("kv_indices"), pybind11::arg("seq_lens"),
           pybind11::arg("scale"), pybind11::arg("extend_lens") = pybind11::none(),
           pybind11::arg("capture") = std::vector<int64_t>{});
}
