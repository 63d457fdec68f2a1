// Each row's argmax: greedy decoding's choice, and greedy verification's after every tree node.
//
// torch.argmax walks a row one element at a time beside its index: ~63 us a row of a
// 49,152-token vocabulary on these cores, a step's largest cost after the forward (a verify
// round of 16 nodes paid ~0.5 ms for it). Here a row takes two vector passes while it stays in
// cache: its largest value (noting any NaN), then the first index holding it. The result is
// torch.argmax's: the first of equal largest values, the first NaN where a row has one.

// The row's largest value, or NaN where it has a NaN (comparisons with NaN are false, so the
// vector maxima skip them; their lanes are noted apart).
inline float row_max(const float* x, int64_t n, bool* nan) {
  int64_t i = 0;
  float best = x[0];
  bool unordered = false;
#if defined(SPECTRAL_VEC)
  using spectral_cpu::Vec;
  if (n >= Vec::kWidth) {
    Vec::R m = Vec::load(x);
    unsigned u = Vec::nan_lanes(m);
    for (i = Vec::kWidth; i + Vec::kWidth <= n; i += Vec::kWidth) {
      Vec::R v = Vec::load(x + i);
      u |= Vec::nan_lanes(v);
      m = Vec::max(m, v);
    }
    unordered = u != 0;
    best = Vec::reduce_max(m);
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
#if defined(SPECTRAL_VEC)
  using spectral_cpu::Vec;
  const Vec::R want = Vec::set1(value);
  for (; i + Vec::kWidth <= n; i += Vec::kWidth) {
    unsigned hit = Vec::equal_lanes(Vec::load(x + i), want);
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
