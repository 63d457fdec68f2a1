"""The layers models and draft heads are built from: linear (dense, packed, GGUF blocks),
RMSNorm, rotary embeddings."""
