"""Attention over the paged KV cache: one interface (base), one file per backend (torch with
spectral's CPU decode kernel, triton, flashinfer), chosen by name in the registry."""
