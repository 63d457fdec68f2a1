// Fused CPU ops for the decode path, each the same math as its PyTorch reference in spectral
// (float32 arithmetic inside, results cast to the tensor dtype):
//   add_rms_norm: optional residual add, then RMSNorm (transformers' order of operations)
//   rotary_inplace: rotate-half rotary embedding of q and k, in place
//   silu_mul: silu(gate) * up of a fused gate|up projection
//   decode_attention: query rows over their KV slots (decode, tree and prefill rows alike),
//   grouped-query heads (rows that start with the same keys read them once)
#include <ATen/ATen.h>
#include <torch/python.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(at::BFloat16* p, int64_t i, float v) { p[i] = static_cast<at::BFloat16>(v); }
// transformers rounds the normalised value to the model dtype before the weight multiply.
inline float round_to(const float*, float v) { return v; }
inline float round_to(const at::BFloat16*, float v) {
  return static_cast<float>(static_cast<at::BFloat16>(v));
}

// Elements of work a thread must have at least before a row-wise op is split over threads:
// below it, handing rows to the other thread and waiting for it costs more than the rows (a
// norm or rotary of a few rows runs in a microsecond or two, a fork and join of the OpenMP team
// in a few).
constexpr int64_t kMinSplitElements = 16384;

// Rows of `width` elements a thread takes at least (at::parallel_for's grain).
inline int64_t rows_grain(int64_t width) {
  return std::max<int64_t>(1, kMinSplitElements / std::max<int64_t>(width, 1));
}

template <typename T>
void add_rms_norm_impl(T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t h,
                       double eps) {
  at::parallel_for(0, rows, rows_grain(h), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * h;
      if (residual != nullptr) {
        T* rr = residual + r * h;
        // residual <- x + residual (in the model dtype), the norm reads the sum
        for (int64_t i = 0; i < h; ++i) store(rr, i, round_to(rr, load(xr, i) + load(rr, i)));
        xr = rr;
      }
      float sum = 0.f;
      for (int64_t i = 0; i < h; ++i) {
        float v = load(xr, i);
        sum += v * v;
      }
      float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + static_cast<float>(eps));
      T* orow = out + r * h;
      for (int64_t i = 0; i < h; ++i)
        store(orow, i, round_to(orow, round_to(orow, load(xr, i) * inv) * load(weight, i)));
    }
  });
}

template <typename T>
void rotary_impl(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t row_stride,
                 const float* cos, const float* sin, const int64_t* positions) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens * heads, rows_grain(dim), [&](int64_t a, int64_t b) {
    std::vector<float> tmp(dim);
    for (int64_t th = a; th < b; ++th) {
      const int64_t t = th / heads;
      T* v = x + t * row_stride + (th % heads) * dim;
      const float* c = cos + positions[t] * dim;
      const float* s = sin + positions[t] * dim;
      for (int64_t i = 0; i < dim; ++i) tmp[i] = load(v, i);
      // transformers: x * cos + rotate_half(x) * sin, with cos/sin cast to the model dtype
      for (int64_t i = 0; i < dim; ++i) {
        float rot = i < half ? -tmp[i + half] : tmp[i - half];
        float ci = round_to(v, c[i]), si = round_to(v, s[i]);
        store(v, i, round_to(v, round_to(v, tmp[i] * ci) + round_to(v, rot * si)));
      }
    }
  });
}

// KV rows are gathered by slot index, so hardware prefetchers cannot guess them: fetch the
// rows a few keys ahead ourselves.
constexpr int64_t kPrefetch = 8;

template <typename T>
inline void prefetch_head(const T* p, int64_t dim) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(c + off, 0, 3);
}

// dot(q, k) and acc += p * v over one head of `dim` values (float32 q and acc).
template <typename T>
inline float dot_head(const float* q, const T* k, int64_t dim) {
#if defined(SPECTRAL_VEC)
  using spectral_cpu::Vec;
  if (dim % Vec::kWidth == 0) {
    Vec::R acc = Vec::zero();
    for (int64_t d = 0; d < dim; d += Vec::kWidth)
      acc = Vec::fma(Vec::load(q + d), spectral_cpu::load(k + d), acc);
    return Vec::reduce(acc);
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < dim; ++d) s += q[d] * load(k, d);
  return s;
}

template <typename T>
inline void axpy_head(float p, const T* v, float* acc, int64_t dim) {
#if defined(SPECTRAL_VEC)
  using spectral_cpu::Vec;
  if (dim % Vec::kWidth == 0) {
    Vec::R pv = Vec::set1(p);
    for (int64_t d = 0; d < dim; d += Vec::kWidth)
      Vec::store(acc + d, Vec::fma(pv, spectral_cpu::load(v + d), Vec::load(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < dim; ++d) acc[d] += p * load(v, d);
}

#if defined(SPECTRAL_VEC)
using spectral_cpu::Vec;

// e^x in every lane: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by Cephes' degree-6
// polynomial, times 2^n built in the exponent bits. Within 2 ulp of std::exp where the result
// is a normal float; x is clamped to [-87.3, 88.0], so far-below values give ~1e-38, not 0.
inline Vec::R exp_vec(Vec::R x) {
#if SPECTRAL_VEC == 512
  using I = __m512i;
  x = _mm512_max_ps(_mm512_min_ps(x, Vec::set1(88.0f)), Vec::set1(-87.3f));
  const Vec::R n = _mm512_roundscale_ps(_mm512_mul_ps(x, Vec::set1(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  auto mul = [](Vec::R a, Vec::R b) { return _mm512_mul_ps(a, b); };
  auto fnma = [](Vec::R a, Vec::R b, Vec::R c) { return _mm512_fnmadd_ps(a, b, c); };
  auto scale = [](Vec::R v) {
    const I e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
  };
#else
  using I = __m256i;
  x = _mm256_max_ps(_mm256_min_ps(x, Vec::set1(88.0f)), Vec::set1(-87.3f));
  const Vec::R n = _mm256_round_ps(_mm256_mul_ps(x, Vec::set1(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  auto mul = [](Vec::R a, Vec::R b) { return _mm256_mul_ps(a, b); };
  auto fnma = [](Vec::R a, Vec::R b, Vec::R c) { return _mm256_fnmadd_ps(a, b, c); };
  auto scale = [](Vec::R v) {
    const I e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
  };
#endif
  Vec::R r = fnma(n, Vec::set1(0.693359375f), x);
  r = fnma(n, Vec::set1(-2.12194440e-4f), r);
  Vec::R p = Vec::set1(1.9875691500e-4f);
  p = Vec::fma(p, r, Vec::set1(1.3981999507e-3f));
  p = Vec::fma(p, r, Vec::set1(8.3334519073e-3f));
  p = Vec::fma(p, r, Vec::set1(4.1665795894e-2f));
  p = Vec::fma(p, r, Vec::set1(1.6666665459e-1f));
  p = Vec::fma(p, r, Vec::set1(5.0000001201e-1f));
  p = Vec::fma(p, mul(r, r), Vec::add(r, Vec::set1(1.f)));
  return mul(p, scale(n));
}
#endif

// scores[0..len) <- softmax(scores[0..len)), in place.
inline void softmax_inplace(float* s, int64_t len) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < len; ++l) mx = std::max(mx, s[l]);
  float total = 0.f;
  int64_t l = 0;
#if defined(SPECTRAL_VEC)
  using spectral_cpu::Vec;
  const Vec::R neg_max = Vec::set1(-mx);
  Vec::R sum = Vec::zero();
  for (; l + Vec::kWidth <= len; l += Vec::kWidth) {
    const Vec::R e = exp_vec(Vec::add(Vec::load(s + l), neg_max));
    Vec::store(s + l, e);
    sum = Vec::add(sum, e);
  }
  total = Vec::reduce(sum);
#endif
  for (; l < len; ++l) {
    s[l] = std::exp(s[l] - mx);
    total += s[l];
  }
  const float inv = 1.f / total;
  for (l = 0; l < len; ++l) s[l] *= inv;
}

// acc[0..dim) += p[l] * v(row l) for l in [l0, l1), the rows given by slot, l in order: each
// value gets the same sum, to the bit, whatever blocks the keys are taken in.
template <typename T>
inline void weighted_values(const float* p, const T* vbuf, const int64_t* idx, int64_t l0,
                            int64_t l1, int64_t row_stride, int64_t dim, float* acc) {
#if defined(SPECTRAL_VEC)
  using spectral_cpu::Vec;
  constexpr int kVecs = 64 / Vec::kWidth;  // 64 values a pass, in registers
  if (dim % 64 == 0) {
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
      Vec::R a[kVecs];
      for (int j = 0; j < kVecs; ++j) a[j] = Vec::load(acc + d0 + j * Vec::kWidth);
      for (int64_t l = l0; l < l1; ++l) {
        const T* v = vbuf + idx[l] * row_stride + d0;
        const Vec::R pl = Vec::set1(p[l]);
        for (int j = 0; j < kVecs; ++j)
          a[j] = Vec::fma(pl, spectral_cpu::load(v + j * Vec::kWidth), a[j]);
      }
      for (int j = 0; j < kVecs; ++j) Vec::store(acc + d0 + j * Vec::kWidth, a[j]);
    }
    return;
  }
#endif
  for (int64_t l = l0; l < l1; ++l) axpy_head(p[l], vbuf + idx[l] * row_stride, acc, dim);
}

// scores[i * stride] = dot_head(q + i * dim, k) for i < n: four queries at a time against
// the key's values as they are loaded (each sum the one dot_head makes, to the bit).
template <typename T>
inline void dot_queries(const float* q, int64_t n, const T* k, int64_t dim, float* scores,
                        int64_t stride) {
  int64_t i = 0;
#if defined(SPECTRAL_VEC)
  using spectral_cpu::Vec;
  if (dim % Vec::kWidth == 0) {
    for (; i + 4 <= n; i += 4) {
      const float* qi = q + i * dim;
      Vec::R a0 = Vec::zero(), a1 = Vec::zero(), a2 = Vec::zero(), a3 = Vec::zero();
      for (int64_t d = 0; d < dim; d += Vec::kWidth) {
        const Vec::R kv = spectral_cpu::load(k + d);
        a0 = Vec::fma(Vec::load(qi + d), kv, a0);
        a1 = Vec::fma(Vec::load(qi + dim + d), kv, a1);
        a2 = Vec::fma(Vec::load(qi + 2 * dim + d), kv, a2);
        a3 = Vec::fma(Vec::load(qi + 3 * dim + d), kv, a3);
      }
      scores[i * stride] = Vec::reduce(a0);
      scores[(i + 1) * stride] = Vec::reduce(a1);
      scores[(i + 2) * stride] = Vec::reduce(a2);
      scores[(i + 3) * stride] = Vec::reduce(a3);
    }
  }
#endif
  for (; i < n; ++i) scores[i * stride] = dot_head(q + i * dim, k, dim);
}

// Keys per block of the weighted values: every query of a group takes the block's value rows
// while they are in the L1 cache.
constexpr int64_t kValueBlock = 64;

// A query row's keys: `len` KV slots from `idx`.
struct RowKeys {
  const int64_t* idx;
  int64_t len;
};

// Rows that read the same keys first share them: consecutive rows whose slot lists start alike
// (a verified tree's rows, a prefill's causal rows) form a group (at most kGroupRows rows, for
// balance over threads; twice that in a long prefill), and each key of the shared part is read
// once for all of the group's queries. A row's arithmetic is its own whatever its group: its
// result depends only on its query and its keys, never on which rows share the call
// (tests/test_cpu_kernels.py holds it to the same row computed alone).
constexpr int64_t kGroupRows = 8;
constexpr int64_t kMinShared = 16;

template <typename T>
void attention_rows_impl(const T* q, const T* kbuf, const T* vbuf, const std::vector<RowKeys>& rows,
                         T* out, int64_t heads, int64_t kv_heads, int64_t dim, int64_t q_stride,
                         double scale) {
  const int64_t batch = static_cast<int64_t>(rows.size());
  const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
  const int64_t group_rows = batch >= 256 ? 2 * kGroupRows : kGroupRows;
  // Groups of rows [start, end) and the keys all of them share.
  std::vector<int64_t> starts, shared;
  for (int64_t r = 0; r < batch;) {
    int64_t end = r + 1, common = rows[r].len;
    const int64_t* first = rows[r].idx;
    while (end < batch && end - r < group_rows) {
      const int64_t* other = rows[end].idx;
      const int64_t most = std::min(common, rows[end].len);
      int64_t lcp = other == first ? most : 0;
      while (lcp < most && other[lcp] == first[lcp]) ++lcp;
      if (lcp < kMinShared) break;
      common = lcp;
      ++end;
    }
    starts.push_back(r);
    shared.push_back(end - r > 1 ? common : 0);
    r = end;
  }
  starts.push_back(batch);
  const int64_t groups = static_cast<int64_t>(shared.size());
  at::parallel_for(0, groups * kv_heads, 1, [&](int64_t a, int64_t b) {
    std::vector<float> qf, scores, acc;
    for (int64_t task = a; task < b; ++task) {
      // Groups taken first, last, second, second to last...: the threads' contiguous shares
      // of tasks then hold as many long rows as short ones (a prefill's rows grow).
      const int64_t k = task / kv_heads, kh = task % kv_heads;
      const int64_t gi = k % 2 == 0 ? k / 2 : groups - 1 - k / 2;
      const int64_t r0 = starts[gi], count = starts[gi + 1] - r0, common = shared[gi];
      const int64_t queries = count * group;
      int64_t longest = 0;
      for (int64_t r = r0; r < r0 + count; ++r) longest = std::max(longest, rows[r].len);
      qf.resize(queries * dim);
      scores.resize(queries * longest);
      for (int64_t r = 0; r < count; ++r)
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < dim; ++d)
            qf[(r * group + g) * dim + d] =
                load(q, (r0 + r) * q_stride + (kh * group + g) * dim + d) * static_cast<float>(scale);
      // Scores over the shared keys, each key read once for every query of the group.
      const int64_t* idx0 = rows[r0].idx;
      for (int64_t l = 0; l < common; ++l) {
        if (l + kPrefetch < common) prefetch_head(kbuf + idx0[l + kPrefetch] * row_stride + kh * dim, dim);
        const T* krow = kbuf + idx0[l] * row_stride + kh * dim;
        dot_queries(qf.data(), queries, krow, dim, scores.data() + l, longest);
      }
      // Each row's own keys, then its softmax.
      for (int64_t r = 0; r < count; ++r) {
        const int64_t len = rows[r0 + r].len;
        const int64_t* idx = rows[r0 + r].idx;
        for (int64_t l = common; l < len; ++l) {
          if (l + kPrefetch < len) prefetch_head(kbuf + idx[l + kPrefetch] * row_stride + kh * dim, dim);
          const T* krow = kbuf + idx[l] * row_stride + kh * dim;
          dot_queries(qf.data() + r * group * dim, group, krow, dim,
                      scores.data() + r * group * longest + l, longest);
        }
        for (int64_t g = 0; g < group; ++g) softmax_inplace(scores.data() + (r * group + g) * longest, len);
      }
      // The weighted values, block of keys after block of keys for every query.
      acc.assign(queries * dim, 0.f);
      const int64_t len0 = rows[r0].len;  // the group's first row: its keys cover the shared
      for (int64_t l = 0; l < std::min(len0, kValueBlock); ++l)
        prefetch_head(vbuf + idx0[l] * row_stride + kh * dim, dim);
      for (int64_t l0 = 0; l0 < longest; l0 += kValueBlock) {
        // The next block's value rows, fetched while this one is summed.
        for (int64_t l = l0 + kValueBlock; l < std::min(len0, l0 + 2 * kValueBlock); ++l)
          prefetch_head(vbuf + idx0[l] * row_stride + kh * dim, dim);
        for (int64_t r = 0; r < count; ++r) {
          const int64_t l1 = std::min(rows[r0 + r].len, l0 + kValueBlock);
          for (int64_t g = 0; l0 < l1 && g < group; ++g) {
            const int64_t i = r * group + g;
            weighted_values(scores.data() + i * longest, vbuf + kh * dim, rows[r0 + r].idx, l0,
                            l1, row_stride, dim, acc.data() + i * dim);
          }
        }
      }
      for (int64_t r = 0; r < count; ++r)
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < dim; ++d)
            store(out, ((r0 + r) * heads + kh * group + g) * dim + d, acc[(r * group + g) * dim + d]);
    }
  });
}

// out[t, i] = silu(g) * u for g = gate_up[t, i], u = gate_up[t, I + i]: silu(g) = g / (1 +
// e^-g) in float32, rounded to T (as torch's silu gives it), then the product rounded to T.
template <typename T>
void silu_mul_impl(const T* gate_up, T* out, int64_t tokens, int64_t inter) {
  at::parallel_for(0, tokens, rows_grain(2 * inter), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* g = gate_up + t * 2 * inter;
      const T* u = g + inter;
      T* o = out + t * inter;
      int64_t i = 0;
#if defined(SPECTRAL_VEC)
      if constexpr (std::is_same_v<T, float>) {
        const Vec::R one = Vec::set1(1.f), zero = Vec::zero();
        for (; i + Vec::kWidth <= inter; i += Vec::kWidth) {
          const Vec::R gv = Vec::load(g + i);
          const Vec::R silu = Vec::div(gv, Vec::add(one, exp_vec(Vec::sub(zero, gv))));
          Vec::store(o + i, Vec::mul(silu, Vec::load(u + i)));
        }
      }
#endif
      for (; i < inter; ++i) {
        const float gv = load(g, i);
        const float silu = round_to(o, gv / (1.f + std::exp(-gv)));
        store(o, i, round_to(o, silu * load(u, i)));
      }
    }
  });
}

void check_float_or_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// gate_up [tokens, 2 I] (gate | up) -> silu(gate) * up [tokens, I].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_float_or_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [tokens, 2 I]");
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  torch::Tensor out = torch::empty({tokens, inter}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32)
    silu_mul_impl(gate_up.data_ptr<float>(), out.data_ptr<float>(), tokens, inter);
  else
    silu_mul_impl(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), tokens, inter);
  return out;
}

// Returns (normed, residual_out). With a residual, residual is updated in place to x + residual.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                        const c10::optional<torch::Tensor>& residual,
                                        const torch::Tensor& weight, double eps) {
  check_float_or_bf16(x, "x");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  torch::Tensor out = torch::empty_like(x);
  torch::Tensor xr = x;
  AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm",
                     AT_DISPATCH_CASE(torch::kFloat32, [&] {
                       add_rms_norm_impl<float>(x.data_ptr<float>(),
                                                residual ? residual->data_ptr<float>() : nullptr,
                                                weight.data_ptr<float>(), out.data_ptr<float>(),
                                                rows, h, eps);
                     }) AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                       add_rms_norm_impl<at::BFloat16>(
                           x.data_ptr<at::BFloat16>(),
                           residual ? residual->data_ptr<at::BFloat16>() : nullptr,
                           weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, h,
                           eps);
                     }));
  return {out, residual ? *residual : x};
}

// Rotates heads [0, heads) of every row of x ([tokens, row_len], rows may hold more heads after
// them, e.g. the v part of a fused qkv projection).
void rotary_inplace(torch::Tensor& x, int64_t heads, int64_t dim, const torch::Tensor& cos,
                    const torch::Tensor& sin, const torch::Tensor& positions) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= heads * dim, "x must be [tokens, >= heads * dim]");
  TORCH_CHECK(positions.numel() == x.size(0), "one position per token");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.is_contiguous(), "cos must be float32");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(),
              "positions must be contiguous int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is past the ",
                cos.size(0), " the rotary tables hold");
  AT_DISPATCH_SWITCH(x.scalar_type(), "rotary_inplace",
                     AT_DISPATCH_CASE(torch::kFloat32, [&] {
                       rotary_impl<float>(x.data_ptr<float>(), x.size(0), heads, dim, x.stride(0),
                                          cos.data_ptr<float>(), sin.data_ptr<float>(),
                                          positions.data_ptr<int64_t>());
                     }) AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                       rotary_impl<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.size(0), heads, dim,
                                                 x.stride(0), cos.data_ptr<float>(),
                                                 sin.data_ptr<float>(),
                                                 positions.data_ptr<int64_t>());
                     }));
}

// Attention of query rows over KV slots of the pool, grouped-query heads. Decode and tree rows
// (extend_lens absent): row r reads kv_indices[r, :seq_lens[r]]. Extend rows (extend_lens
// [B]): request j's kv_indices[j, :seq_lens[j]] end with its extend_lens[j] new tokens, whose
// rows (consecutive, request after request) each see the keys up to and including their own
// (causal). Either way a row's result does not depend on the other rows of the call.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_buf,
                               const torch::Tensor& v_buf, const torch::Tensor& kv_indices,
                               const torch::Tensor& seq_lens, double scale,
                               const c10::optional<torch::Tensor>& extend_lens) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3,
              "q: [tokens, heads, dim], k_buf: [slots, kv_heads, dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each row of q must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type(), "q and the KV pool dtypes differ");
  TORCH_CHECK(kv_indices.scalar_type() == torch::kInt64 && kv_indices.is_contiguous() &&
                  kv_indices.dim() == 2,
              "kv_indices must be contiguous int64 [rows or requests, width]");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_buf.size(1), width = kv_indices.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
  const torch::Tensor lens = seq_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(lens.numel() == kv_indices.size(0), "one length per row of kv_indices");
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  std::vector<RowKeys> rows;
  rows.reserve(tokens);
  if (extend_lens.has_value()) {
    const torch::Tensor ext = extend_lens->to(torch::kInt64).contiguous();
    TORCH_CHECK(ext.numel() == lens.numel(), "one extend length per request");
    const int64_t* e = ext.data_ptr<int64_t>();
    for (int64_t j = 0; j < lens.numel(); ++j) {
      TORCH_CHECK(e[j] >= 0 && e[j] <= len[j] && len[j] <= width, "request ", j, " extends ",
                  e[j], " tokens of ", len[j], " in rows of ", width, " slots");
      for (int64_t i = 0; i < e[j]; ++i) rows.push_back({idx + j * width, len[j] - e[j] + i + 1});
    }
  } else {
    for (int64_t r = 0; r < lens.numel(); ++r) {
      TORCH_CHECK(len[r] >= 0 && len[r] <= width, "row ", r, " reads ", len[r], " of ", width, " slots");
      rows.push_back({idx + r * width, len[r]});
    }
  }
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == tokens, "q has ", tokens, " rows, the slots ",
              rows.size());
  torch::Tensor out = torch::empty({tokens, heads, dim}, q.options());
  AT_DISPATCH_SWITCH(q.scalar_type(), "decode_attention",
                     AT_DISPATCH_CASE(torch::kFloat32, [&] {
                       attention_rows_impl<float>(q.data_ptr<float>(), k_buf.data_ptr<float>(),
                                                  v_buf.data_ptr<float>(), rows,
                                                  out.data_ptr<float>(), heads, kv_heads, dim,
                                                  q.stride(0), scale);
                     }) AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                       attention_rows_impl<at::BFloat16>(
                           q.data_ptr<at::BFloat16>(), k_buf.data_ptr<at::BFloat16>(),
                           v_buf.data_ptr<at::BFloat16>(), rows, out.data_ptr<at::BFloat16>(),
                           heads, kv_heads, dim, q.stride(0), scale);
                     }));
  return out;
}

namespace {

// Row by row: every logit whose bit in the row's mask is 0 becomes -inf. Token t is bit t % 32
// of word t // 32 (xgrammar's layout); a word of all ones (every token allowed) is skipped, a
// word of zeros is filled at once.
template <typename T>
void apply_token_bitmask_impl(T* logits, const uint32_t* mask, int64_t rows, int64_t vocab,
                              int64_t words) {
  const T minus_inf = static_cast<T>(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    T* row = logits + r * vocab;
    const uint32_t* bits = mask + r * words;
    for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
      const uint32_t word = bits[w];
      if (word == 0xFFFFFFFFu) continue;
      const int64_t end = std::min<int64_t>(32, vocab - w * 32);
      T* out = row + w * 32;
      if (word == 0) {
        std::fill(out, out + end, minus_inf);
        continue;
      }
      for (int64_t t = 0; t < end; ++t) {
        if (!((word >> t) & 1u)) out[t] = minus_inf;
      }
    }
  }
}

}  // namespace

// logits [rows, vocab] (float32 or bfloat16, contiguous), in place; bitmask [rows, words] int32.
void apply_token_bitmask(torch::Tensor& logits, const torch::Tensor& bitmask) {
  check_float_or_bf16(logits, "logits");
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "bitmask must be contiguous int32");
  TORCH_CHECK(logits.dim() == 2 && bitmask.dim() == 2 && bitmask.size(0) == logits.size(0),
              "logits [rows, vocab] and bitmask [rows, words] must have the same rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "bitmask has ", words, " words, fewer than ", vocab, " bits");
  const auto* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  if (logits.scalar_type() == torch::kFloat32) {
    apply_token_bitmask_impl(logits.data_ptr<float>(), mask, rows, vocab, words);
  } else {
    apply_token_bitmask_impl(logits.data_ptr<at::BFloat16>(), mask, rows, vocab, words);
  }
}

void register_fused_ops(pybind11::module& m) {
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "in place: -inf where the row's token bitmask (int32 words, bit t % 32 of word t // 32) "
        "is 0");
  m.def("add_rms_norm", &add_rms_norm, "(x [+ residual]) -> RMSNorm; returns (normed, residual)");
  m.def("rotary_inplace", &rotary_inplace, "rotate-half rotary embedding, in place");
  m.def("silu_mul", &silu_mul, "gate_up [tokens, 2 I] -> silu(gate) * up [tokens, I]");
  m.def("decode_attention", &decode_attention,
        "query rows over KV slots: one row per kv_indices row, or (extend_lens) each request's "
        "new tokens, causal",
        pybind11::arg("q"), pybind11::arg("k_buf"), pybind11::arg("v_buf"),
        pybind11::arg("kv_indices"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("extend_lens") = pybind11::none());
}
