"""Raw kernels only: spectral's C++ CPU library and its loader (cpu_kernels), and Triton
kernels (triton/). The attention backends built on them live in spectral.attention, the layers
in spectral.layers."""
