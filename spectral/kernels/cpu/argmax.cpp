// Each row's argmax: greedy decoding's choice, and greedy verification's after every tree node.
//
// torch.argmax walks a row one element at a time beside its index: ~63 us a row of a
// 49,152-token vocabulary on these cores, a step's largest cost after the forward (a verify
// round of 16 nodes paid ~0.5 ms for it). Here a row takes two vector passes while it stays in
// cache: its largest value (noting any NaN), then the first index holding it. The result is
// torch.argmax's: the first of equal largest values, the first NaN where a row has one.

// The row's largest value, or NaN where it has a NaN (comparisons with NaN are false, so the
// vector maxima skip them; their count says whether there were any).
inline float row_max(const float* x, int64_t n, bool* nan) {
  int64_t i = 0;
  float best = x[0];
  bool unordered = false;
#if SPECTRAL_VEC == 512
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(x);
    __mmask16 u = _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      __m512 v = _mm512_loadu_ps(x + i);
      u |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, v);
    }
    unordered = u != 0;
    best = _mm512_reduce_max_ps(m);
  }
#elif SPECTRAL_VEC == 256
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    __m256 u = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      __m256 v = _mm256_loadu_ps(x + i);
      u = _mm256_or_ps(u, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m = _mm256_max_ps(m, v);
    }
    unordered = _mm256_movemask_ps(u) != 0;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    best = _mm_cvtss_f32(h);
  }
#endif
  for (; i < n; ++i) {
    unordered = unordered || x[i] != x[i];
    best = x[i] > best ? x[i] : best;
  }
  *nan = unordered || best != best;
  return best;
}

// The first index in [0, n) whose value equals `value` (not NaN), n where none does.
inline int64_t first_equal(const float* x, int64_t n, float value) {
  int64_t i = 0;
#if SPECTRAL_VEC == 512
  const __m512 want = _mm512_set1_ps(value);
  for (; i + 16 <= n; i += 16) {
    __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), want, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif SPECTRAL_VEC == 256
  const __m256 want = _mm256_set1_ps(value);
  for (; i + 8 <= n; i += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (x[i] == value) return i;
  return n;
}

inline int64_t argmax_row(const float* x, int64_t n) {
  bool nan = false;
  const float best = row_max(x, n, &nan);
  if (nan) {
    for (int64_t i = 0; i < n; ++i)
      if (x[i] != x[i]) return i;
  }
  return first_equal(x, n, best);
}

// logits [rows, vocab] float32 on the CPU, each row contiguous (rows may be strided) -> [rows]
// int64.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32,
              "argmax_rows takes float32 CPU logits (got ", logits.scalar_type(), " on ",
              logits.device(), ")");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "argmax_rows takes [rows, vocab] logits, vocab > 0, each row contiguous (got ",
              logits.sizes(), ")");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, torch::dtype(torch::kInt64));
  const float* x = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  // a few microseconds a row: threads only where there are rows enough to share
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = argmax_row(x + r * stride, vocab);
  });
  return out;
}

void register_argmax(pybind11::module& m) {
  m.def("argmax_rows", &argmax_rows,
        "each row's argmax as torch.argmax gives it (the first of equal largest values, the "
        "first NaN): logits [rows, vocab] float32 -> [rows] int64");
}
