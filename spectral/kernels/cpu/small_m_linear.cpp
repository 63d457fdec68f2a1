// y = x @ w.T (+ bias) for a few rows of x: the decode-time matmul, a single stream over the
// weights. Each thread takes a contiguous block of weight rows and reads it front to back, one
// row at a time, dotting it with every row of x; several accumulators per dot product hide the
// FMA latency. Sums are float32. Weights and x share a dtype: float32, or bfloat16 (products
// of two bfloat16 values are exact in float32, so the bf16 dot-product instruction and widening
// both give float32 sums of exact products).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

constexpr int64_t kMaxRows = 16;

using spectral_cpu::bf16_to_float;

inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_float(v); }

// Results are written in the weights' dtype (bfloat16 rounded to nearest even).
inline void put(float* out, int64_t i, float v) { out[i] = v; }
inline void put(at::BFloat16* out, int64_t i, float v) { out[i] = static_cast<at::BFloat16>(v); }

// Scalar reference path, used where no vector unit is compiled in.
template <typename T, typename O>
void dot_rows_scalar(const T* w, const T* x, O* out, int64_t m, int64_t n, int64_t k,
                     int64_t n0, int64_t n1) {
  for (int64_t j = n0; j < n1; ++j) {
    for (int64_t q = 0; q < m; ++q) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc += widen(w[j * k + i]) * widen(x[q * k + i]);
      put(out, q * n + j, acc);
    }
  }
}

#if defined(SPECTRAL_VEC)
using spectral_cpu::Vec;

// One vector of products added into an accumulator: float32, or bfloat16 widened to float32.
template <typename TT>
struct WideningOp {
  using T = TT;
  static constexpr int kStep = Vec::kWidth;
  static Vec::R fma(Vec::R acc, const T* w, const T* x) {
    return Vec::fma(Vec::load(w), Vec::load(x), acc);
  }
  // The last len < kStep values, zero-padded (0 * 0 adds nothing).
  static Vec::R fma_tail(Vec::R acc, const T* w, const T* x, int64_t len) {
    T wb[kStep] = {}, xb[kStep] = {};
    std::memcpy(wb, w, len * sizeof(T));
    std::memcpy(xb, x, len * sizeof(T));
    return fma(acc, wb, xb);
  }
};
using F32Op = WideningOp<float>;

#if defined(__AVX512BF16__)
// Pairs of bfloat16 products summed into float32 lanes by the dot-product instruction.
struct Bf16Op {
  using T = uint16_t;
  static constexpr int kStep = 32;
  static __m512 fma(__m512 acc, const T* w, const T* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
  }
  static __m512 fma_tail(__m512 acc, const T* w, const T* x, int64_t len) {
    __mmask32 mask = static_cast<__mmask32>((1ull << len) - 1);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, w),
                            (__m512bh)_mm512_maskz_loadu_epi16(mask, x));
  }
};
#else
using Bf16Op = WideningOp<uint16_t>;
#endif

// M rows of x, A accumulators per row of x (A * M registers).
template <class Op, int M, int A, typename O>
void dot_rows(const typename Op::T* w, const typename Op::T* x, O* out, int64_t n, int64_t k,
              int64_t n0, int64_t n1) {
  constexpr int S = Op::kStep;
  for (int64_t j = n0; j < n1; ++j) {
    const typename Op::T* row = w + j * k;
    Vec::R acc[M][A];
    for (int q = 0; q < M; ++q)
      for (int a = 0; a < A; ++a) acc[q][a] = Vec::zero();
    int64_t i = 0;
    for (; i + S * A <= k; i += S * A)
      for (int a = 0; a < A; ++a)
        for (int q = 0; q < M; ++q) acc[q][a] = Op::fma(acc[q][a], row + i + S * a, x + q * k + i + S * a);
    for (; i + S <= k; i += S)
      for (int q = 0; q < M; ++q) acc[q][0] = Op::fma(acc[q][0], row + i, x + q * k + i);
    if (i < k)
      for (int q = 0; q < M; ++q) acc[q][0] = Op::fma_tail(acc[q][0], row + i, x + q * k + i, k - i);
    for (int q = 0; q < M; ++q) {
      Vec::R sum = acc[q][0];
      for (int a = 1; a < A; ++a) sum = Vec::add(sum, acc[q][a]);
      put(out, q * n + j, Vec::reduce(sum));
    }
  }
}

template <class Op, int M, typename O>
void rows(const typename Op::T* w, const typename Op::T* x, O* out, int64_t n, int64_t k,
          int64_t n0, int64_t n1) {
  dot_rows<Op, M, Vec::accumulators(M), O>(w, x, out, n, k, n0, n1);
}

template <class Op, typename O>
void dispatch(int64_t m, const typename Op::T* w, const typename Op::T* x, O* out, int64_t n,
              int64_t k, int64_t n0, int64_t n1) {
  switch (m) {
    case 1: return rows<Op, 1, O>(w, x, out, n, k, n0, n1);
    case 2: return rows<Op, 2, O>(w, x, out, n, k, n0, n1);
    case 3: return rows<Op, 3, O>(w, x, out, n, k, n0, n1);
    case 4: return rows<Op, 4, O>(w, x, out, n, k, n0, n1);
    case 5: return rows<Op, 5, O>(w, x, out, n, k, n0, n1);
    case 6: return rows<Op, 6, O>(w, x, out, n, k, n0, n1);
    case 7: return rows<Op, 7, O>(w, x, out, n, k, n0, n1);
    case 8: return rows<Op, 8, O>(w, x, out, n, k, n0, n1);
    case 9: return rows<Op, 9, O>(w, x, out, n, k, n0, n1);
    case 10: return rows<Op, 10, O>(w, x, out, n, k, n0, n1);
    case 11: return rows<Op, 11, O>(w, x, out, n, k, n0, n1);
    case 12: return rows<Op, 12, O>(w, x, out, n, k, n0, n1);
    case 13: return rows<Op, 13, O>(w, x, out, n, k, n0, n1);
    case 14: return rows<Op, 14, O>(w, x, out, n, k, n0, n1);
    case 15: return rows<Op, 15, O>(w, x, out, n, k, n0, n1);
    default: return rows<Op, 16, O>(w, x, out, n, k, n0, n1);
  }
}
#endif

template <typename T, typename O>
void run(const T* w, const T* x, O* out, int64_t m, int64_t n, int64_t k) {
  // Blocks of 64 rows keep each thread's stream long and the split even.
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
#if defined(SPECTRAL_VEC)
    if constexpr (std::is_same_v<T, float>) {
      dispatch<F32Op>(m, w, x, out, n, k, n0, n1);
    } else {
      dispatch<Bf16Op>(m, w, x, out, n, k, n0, n1);
    }
#else
    dot_rows_scalar(w, x, out, m, n, k, n0, n1);
#endif
  });
}

}  // namespace

torch::Tensor small_m_linear(const torch::Tensor& x, const torch::Tensor& weight,
                             const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x and weight must be 2-D");
  TORCH_CHECK(x.size(1) == weight.size(1), "x has ", x.size(1), " columns, weight has ",
              weight.size(1));
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "1 to ", kMaxRows, " rows (got ",
              x.size(0), ")");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "float32 or bfloat16 only");

  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty({m, n}, x.options());
  if (dtype == torch::kFloat32) {
    run(weight.data_ptr<float>(), xc.data_ptr<float>(), out.data_ptr<float>(), m, n, k);
  } else {
    run(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
        out.data_ptr<at::BFloat16>(), m, n, k);
  }
  if (bias.has_value()) out.add_(*bias);
  return out;
}


void register_fused_ops(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_fused_ops(m);
  m.def("small_m_linear", &small_m_linear, "x @ weight.T (+ bias) for 1 to 16 rows of x");
  m.def("vector_bits", &spectral_cpu::vector_bits,
        "the vector unit compiled in: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (scalar loops)");
}
