"""Triton kernels for CUDA (and, for tests, Triton's interpreter on CPU tensors:
`TRITON_INTERPRET=1` set before triton is imported)."""
