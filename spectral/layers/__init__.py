"""The layers models and draft heads are built from: linear (dense, packed, GGUF blocks),
RMSNorm, rotary embeddings, the GGUF-block token embedding, the LM head's logits, and the
routing of them all to spectral's CPU kernels."""
