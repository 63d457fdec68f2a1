"""Backends: where programs' gen and select go."""

from spectral.lang.backends.openai_backend import OpenAI
from spectral.lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["OpenAI", "RuntimeEndpoint"]
