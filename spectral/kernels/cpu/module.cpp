// The Python module of spectral's CPU kernels, built as one translation unit: torch's headers
// take most of a build's time (~30 s to parse), so every source file is included here and
// they are parsed once.
#include <ATen/ATen.h>
#include <torch/python.h>

#include "vec.h"

#include "packed_linear.cpp"
#include "quant_linear.cpp"
#include "quant_int8_tiles.cpp"
#include "quant_int8_k_tiles.cpp"
#include "quant_int8_pack.cpp"
#include "quant_int8.cpp"
#include "int8_peak.cpp"
#include "fused_ops.cpp"
#include "argmax.cpp"
#if !defined(SPECTRAL_TEST_BUILD)  // a test build of the kernels, without the fused layer
#include "decoder_layer.cpp"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_fused_ops(m);
  register_argmax(m);
#if !defined(SPECTRAL_TEST_BUILD)
  register_decoder_layer(m);
#endif
  register_packed_linear(m);
  register_quant_linear(m);
  register_quant_int8(m);
  m.def("vector_bits", &spectral_cpu::vector_bits,
        "the vector unit compiled in: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (scalar loops)");
  m.def("int8_peak_macs", &int8_peak_macs,
        "int8 multiply-adds a second of all threads with the integer tiles' instruction, run "
        "for about `seconds` (0 in a scalar build)", pybind11::arg("seconds") = 0.5);
}
