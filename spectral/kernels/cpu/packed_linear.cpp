// y = x @ w.T (+ bias) for any number of rows of x, over weights packed once at load.
//
// Packed layout: the output columns in panels of kNR (two vector registers); panel p holds, for
// every k, the kNR weights of its columns side by side: packed[p][k][c] = w[p * kNR + c][k]
// (zero past the last column). The micro-kernel (panel_tile.h) keeps a tile of kMR rows x kNR
// columns of the output in registers, so each weight is read once per kMR rows of x (once in
// all for a decode step of one request), nothing is summed across lanes, and a panel stays in
// the cache while every block of rows passes over it. Threads split the panels.
//
// Weights are float32 or bfloat16 (widened in registers; products of two bfloat16 values are
// exact in float32); x is used in float32; sums are float32 in order of k; the result has the
// weights' dtype (bfloat16 rounded to nearest even).
#include <ATen/ATen.h>
#include <torch/python.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "panel_tile.h"

namespace {

using namespace spectral_cpu;

template <typename W, typename O>
void run(const float* x, int64_t m, int64_t k, const W* packed, int64_t n, O* out) {
  const int64_t panels = (n + kNR - 1) / kNR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) panel_rows(x, m, k, packed + p * k * kNR, n, p * kNR, out);
  });
}

}  // namespace

torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be 2-D");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "float32 or bfloat16 only");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kNR - 1) / kNR;
  torch::Tensor padded = torch::constant_pad_nd(weight, {0, 0, 0, panels * kNR - n});
  return padded.view({panels, kNR, k}).transpose(1, 2).contiguous();
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kNR && packed.is_contiguous(),
              "packed must come from pack_linear_weight");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " columns, the weights ", packed.size(1));
  TORCH_CHECK(packed.size(0) == (n + kNR - 1) / kNR, "packed holds ", packed.size(0) * kNR,
              " columns, not ", n);
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x and weight dtypes differ");
  torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty({m, n}, x.options());
  if (m > 0) {
    if (packed.scalar_type() == torch::kFloat32) {
      run(xf.data_ptr<float>(), m, k, packed.data_ptr<float>(), n, out.data_ptr<float>());
    } else {
      run(xf.data_ptr<float>(), m, k,
          reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), n,
          out.data_ptr<at::BFloat16>());
    }
  }
  if (bias.has_value()) out.add_(*bias);
  return out;
}

void register_packed_linear(pybind11::module& m) {
  m.def("pack_linear_weight", &pack_linear_weight,
        "weight [n, k] in the panel layout packed_linear streams");
  m.def("packed_linear", &packed_linear, "x @ weight.T (+ bias), weight packed by pack_linear_weight");
  m.def("packed_panel_width", [] { return kNR; }, "output columns per panel of packed weights");
}
