"""spectral's C++ CPU kernels, compiled once per machine (JIT, cached) and optional.

`load_cpu_kernels()` returns the compiled module, or None (with the reason logged) when no
compiler is available; every caller then falls back to the plain PyTorch reference.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from spectral.cache import DEFAULT_CACHE_DIR

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "cpu"
# One translation unit, which includes the other sources (their digest keys the build).
SOURCE = KERNEL_DIR / "module.cpp"


@functools.cache
def cpuinfo_lines() -> tuple[str, ...]:
    """/proc/cpuinfo's lines (Linux), else none."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def cpuinfo_field(key: str) -> str:
    """The value of /proc/cpuinfo's first `key` line (its first processor's), or ""."""
    line = next((line for line in cpuinfo_lines() if line.startswith(key)), ":")
    return line.split(":", 1)[1].strip()


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where there is none."""
    return cpuinfo_field("vendor_id")


def cpu_flags() -> set[str]:
    """The processor's instruction-set flags (/proc/cpuinfo), empty where there are none."""
    return set(cpuinfo_field("flags").split())


def prefetch_locality() -> int:
    """How the matmuls ask for the weights they read next (vec.h's prefetch_ahead), as
    bench/stream.py measured each against no hint: into every cache level on Intel (1.03-1.55x;
    non-temporal there 0.72-1.04x, and it kept a matrix that fits L2 out of it between calls),
    non-temporal elsewhere (an AMD EPYC: 1.03-1.22x)."""
    return 3 if cpu_vendor() == "GenuineIntel" else 0


def cpu_family() -> int:
    """/proc/cpuinfo's cpu family (an AMD Zen 4 is 25, a Zen 5 26), or 0 where there is none."""
    family = cpuinfo_field("cpu family")
    return int(family) if family.isdigit() else 0


def _zen5_or_later() -> bool:
    return cpu_vendor() == "AuthenticAMD" and cpu_family() >= 26


def prefetch_min_rows() -> int:
    """The fewest rows of x an integer tile asks for its weights ahead at (vec.h's
    prefetch_for_rows): 2 on a Zen 4 EPYC (AMD with AVX-512 before family 26: the 1.5B's
    decode forward 0.921x the time with its one-row tiles left to the hardware prefetchers,
    its verify forward of 4 rows 1.36x slower with no hint at any row count), else 1 (a Zen 5
    EPYC: the 1.5B's decode forward 0.944x the time with the hint at one row too)."""
    zen4 = "avx512f" in cpu_flags() and cpu_vendor() == "AuthenticAMD" and cpu_family() < 26
    return 2 if zen4 else 1


def prefetch_ahead() -> int:
    """How many bytes ahead of the block it reads a matmul asks for its weights (vec.h's
    prefetch_ahead): 4096 on a Zen 5 EPYC, whose tiles at 8 rows consume a kilobyte in less
    than a load from memory takes (bench/kernel_ab.py, the 1.5B: decode 0.867x, verify of 4 /
    8 / 16 tokens 0.94x / 0.76x / 0.84x the time at 1024; 512 bytes 1.07-1.15x slower, 2048
    halfway, 8192 and 16384 as 4096), else 1024, as measured on a Zen 4 EPYC and an Intel
    Xeon."""
    return 4096 if _zen5_or_later() else 1024


_AHEAD = f"-DSPECTRAL_PREFETCH_AHEAD={prefetch_ahead()}"  # the runtime's, in the builds that hint

# Builds of the same sources: the widest vector unit the CPU has (what the runtime uses), and
# narrower ones of the kernels without the fused layer (SPECTRAL_TEST_BUILD) that tests hold
# to the same references (AVX2 on an AVX-512 CPU, the scalar loops), at -O1 to cost the suite
# less time.
ISA_FLAGS = {
    "native": [
        "-O3",
        f"-DSPECTRAL_PREFETCH_LOCALITY={prefetch_locality()}",
        f"-DSPECTRAL_PREFETCH_MIN_ROWS={prefetch_min_rows()}",
        _AHEAD,
    ],
    "avx2": ["-O1", "-mno-avx512f", "-DSPECTRAL_TEST_BUILD"],
    "scalar": ["-O1", "-DSPECTRAL_SCALAR", "-DSPECTRAL_TEST_BUILD"],
    # the integer path's VNNI tiles with vpdpbusd emulated in AVX2 (int8_dot.h): their code
    # tested on CPUs without the instruction
    "vnni_emulated": ["-O1", "-mno-avx512f", "-DSPECTRAL_VNNI_EMULATED", "-DSPECTRAL_TEST_BUILD"],
    # the runtime's build without its software prefetches: bench/stream.py's baseline
    "noprefetch": ["-O3", "-DSPECTRAL_PREFETCH_AHEAD=0"],
    # the two ways of asking for the weights ahead (vec.h's prefetch_ahead): bench/stream.py
    "prefetch_nta": ["-O3", "-DSPECTRAL_PREFETCH_LOCALITY=0", _AHEAD],
    "prefetch_t0": ["-O3", "-DSPECTRAL_PREFETCH_LOCALITY=3", _AHEAD],
}
# A build lock older than this was left by a killed build.
STALE_LOCK_S = 900
# Why a build of an instruction set (a key of ISA_FLAGS) gave no kernels, where one did not.
BUILD_ERRORS: dict[str, str] = {}


@functools.cache
def load_cpu_kernels(isa: str = "native") -> ModuleType | None:
    """The kernels built for `isa` (a key of ISA_FLAGS), or None where they cannot be built."""
    build_dir, name = build_dir_of(isa), module_name(isa)
    build_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(build_dir / "lock")
    built = build_dir / f"{name}.so"
    try:
        if built.exists() and not (build_dir / "lock").exists():
            # Built from these very sources: imported as it is, whatever checkout asks (torch's
            # loader would rebuild it for a build file naming other paths).
            module = _import_extension(name, built)
        else:
            logger.info("compiling spectral's CPU kernels (once per machine, ~40 s)")
            module = compile_kernels(name, isa, build_dir)
    except Exception as err:  # a missing compiler or ninja must not stop the runtime
        logger.warning("CPU kernels unavailable, using PyTorch matmuls (%s)", err)
        BUILD_ERRORS[isa] = f"{type(err).__name__}: {err}"
        return None
    if isa == "native" and module.vector_bits() == 0:
        logger.warning(
            "CPU kernels built without AVX2 or AVX-512: their scalar loops are slower than "
            "PyTorch's; --disable-cpu-kernels runs the PyTorch references"
        )
    return module


def module_name(isa: str) -> str:
    return "spectral_cpu_kernels" if isa == "native" else f"spectral_cpu_kernels_{isa}"


def build_dir_of(isa: str) -> Path:
    """Where the build of `isa` from these sources, for this CPU, torch and Python, lives."""
    digest = hashlib.sha256(" ".join([isa, *ISA_FLAGS[isa]]).encode())  # flags change the build
    for src in sorted(p for p in KERNEL_DIR.iterdir() if p.is_file()):
        digest.update(src.name.encode() + src.read_bytes())
    digest.update(torch.__version__.encode() + sys.version.encode())
    digest.update(cpu_signature().encode())  # -march=native: a build runs only on its own CPU
    return DEFAULT_CACHE_DIR / "kernels" / digest.hexdigest()[:16]


def is_built(isa: str) -> bool:
    return (build_dir_of(isa) / f"{module_name(isa)}.so").exists()


def compile_kernels(
    name: str, isa: str, build_dir: Path, source: Path = SOURCE, defines: tuple[str, ...] = ()
) -> ModuleType:
    """The kernels of `source` (another checkout's, for bench/kernel_ab.py) built for `isa`,
    with -D `defines`, as module `name` in `build_dir`."""
    from torch.utils.cpp_extension import load

    return load(
        name=name,
        sources=[str(source)],
        extra_cflags=["-march=native", "-fopenmp", *ISA_FLAGS[isa], *(f"-D{d}" for d in defines)],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def _import_extension(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _remove_stale_lock(lock: Path) -> None:
    """torch's build lock left by a process killed while compiling (a build takes about a
    minute; every later load would wait for that lock forever)."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing a stale kernel build lock (%s)", lock)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def cpu_signature() -> str:
    """The processor's model and instruction-set flags (Linux), else what platform knows."""
    wanted = [line for line in cpuinfo_lines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or f"{platform.machine()} {platform.processor()}"
