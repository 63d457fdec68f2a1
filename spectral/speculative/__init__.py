"""Speculative decoding: draft trees, verification, drafters."""
