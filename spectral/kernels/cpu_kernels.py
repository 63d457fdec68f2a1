"""spectral's C++ CPU kernels, compiled once per machine (JIT, cached) and optional.

`load_cpu_kernels()` returns the compiled module, or None (with the reason logged) when no
compiler is available; every caller then falls back to the plain PyTorch reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

from spectral.cache import DEFAULT_CACHE_DIR

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "cpu" / name
    for name in ("module.cpp", "fused_ops.cpp", "packed_linear.cpp", "quant_linear.cpp")
]


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    digest = hashlib.sha256()
    for src in [*SOURCES, Path(__file__).parent / "cpu" / "vec.h"]:
        digest.update(src.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(cpu_signature().encode())  # -march=native: a build runs only on its own CPU
    build_dir = DEFAULT_CACHE_DIR / "kernels" / digest.hexdigest()[:16]
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils.cpp_extension import load

        if not (build_dir / "spectral_cpu_kernels.so").exists():
            logger.info("compiling spectral's CPU kernels (once per machine, ~30 s)")
        module = load(
            name="spectral_cpu_kernels",
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as err:  # a missing compiler or ninja must not stop the runtime
        logger.warning("CPU kernels unavailable, using PyTorch matmuls (%s)", err)
        return None
    if module.vector_bits() == 0:
        logger.warning(
            "CPU kernels built without AVX2 or AVX-512: their scalar loops are slower than "
            "PyTorch's; --disable-cpu-kernels runs the PyTorch references"
        )
    return module


def cpu_signature() -> str:
    """The processor's model and instruction-set flags (Linux), else what platform knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or f"{platform.machine()} {platform.processor()}"
