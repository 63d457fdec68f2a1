"""Attention backends: one interface, one implementation per device family."""

from spectral.kernels.base import AttentionBackend, create_attention_backend

__all__ = ["AttentionBackend", "create_attention_backend"]
