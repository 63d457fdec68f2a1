"""Where spectral keeps what it builds once per machine: converted models, compiled kernels."""

from pathlib import Path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "spectral"
