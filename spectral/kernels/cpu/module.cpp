// The Python module of spectral's CPU kernels: what each source file registers.
#include <torch/extension.h>

#include "vec.h"

void register_fused_ops(pybind11::module& m);
void register_packed_linear(pybind11::module& m);
void register_quant_linear(pybind11::module& m);
void register_decoder_layer(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if !defined(SPECTRAL_MATMULS_ONLY)  // a test build of the matmuls alone
  register_fused_ops(m);
  register_decoder_layer(m);
#endif
  register_packed_linear(m);
  register_quant_linear(m);
  m.def("vector_bits", &spectral_cpu::vector_bits,
        "the vector unit compiled in: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (scalar loops)");
}
