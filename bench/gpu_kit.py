"""The GPU kit: the wheels a lent GPU machine needs to run spectral, `tests/gpu` and
`bench/gpu.py`, downloaded here because that machine reaches no package registry.

Its image already holds torch, triton, transformers, numpy and most of what they import
(IMAGE_PACKAGES, as the device tool lists them); the kit is the rest, cp312 manylinux x86_64
wheels pinned one version each, fetched `--no-deps` so nothing the image has comes twice.

    python bench/gpu_kit.py            # download into .gpu-kit/ (make gpu-kit), then check
    python bench/gpu_kit.py --check    # check only: every wheel present, every requirement
                                       # met by the kit or the image, the total under the cap
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

KIT_DIR = Path(__file__).resolve().parent.parent / ".gpu-kit"
# A device call carries 64 MiB of working tree; the rest is for the tree itself.
MAX_BYTES = 56 * 2**20

# What spectral, tests/gpu and bench/gpu.py import that the image lacks, and what those need.
KIT = {
    "pyzmq": "27.3.0",
    "fastapi": "0.165.0",
    "starlette": "1.10.0",
    "opentelemetry-api": "1.44.0",
    "importlib-metadata": "8.7.0",
    "uvicorn": "0.54.0",
    "orjson": "3.13.0",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "gguf": "0.19.0",
    "xgrammar": "0.2.8",
    # 0.7's wheel alone is 62 MB; 0.6.18 is the newest that fits, and it imports without
    # cutlass-dsl, cudnn-frontend, cuda-tile or nccl4py (only its GEMM/MoE/comm paths use them).
    "flashinfer-python": "0.6.18.post1",
    "apache-tvm-ffi": "0.1.15.post2",
}
# Requirements of kit wheels left out on purpose: imported only by code spectral never runs.
NOT_NEEDED = {"nvidia-cutlass-dsl", "nvidia-cudnn-frontend", "cuda-tile", "nccl4py", "cuda-python"}

# The GPU image's Python packages (python 3.12), as the device tool's KINDS.md lists them.
IMAGE_PACKAGES = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
    lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
    ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
    pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
    psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
    torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
    treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
    werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)
TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def download(kit_dir: Path) -> None:
    """Fetch each pinned wheel not yet in `kit_dir` (no dependencies: they are pinned too)."""
    kit_dir.mkdir(exist_ok=True)
    have = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in kit_dir.glob("*.whl")}
    missing = [f"{n}=={v}" for n, v in KIT.items() if canonicalize_name(n) not in have]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, "-d", str(kit_dir), *missing], check=True)


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(z.read(name).decode())
    return [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]


def check(kit_dir: Path) -> list[str]:
    """What is wrong with the kit in `kit_dir` (nothing: an empty list)."""
    problems = []
    wheels = sorted(kit_dir.glob("*.whl"))
    versions: dict[str, list[str]] = {}
    for w in wheels:
        name, version, _, tags = parse_wheel_filename(w.name)
        versions.setdefault(canonicalize_name(name), []).append(str(version))
        if not any(
            t.interpreter in ("py3", "cp312") and t.platform in ("any", *PLATFORMS) for t in tags
        ):
            problems.append(f"{w.name} is not a cp312 manylinux x86_64 wheel")
    for name, found in versions.items():
        if len(found) > 1:
            problems.append(f"{name}: {len(found)} versions ({', '.join(found)}); keep one")
    for name, version in KIT.items():
        if versions.get(canonicalize_name(name)) != [version]:
            problems.append(f"{name}=={version} is missing; run: make gpu-kit")
    for w in wheels:
        for req in requirements(w):
            if req.marker is not None and not req.marker.evaluate(TARGET):
                continue
            name = canonicalize_name(req.name)
            if name in IMAGE_PACKAGES or name in NOT_NEEDED:
                continue
            have = versions.get(name)
            if not have:
                problems.append(f"{w.name} needs {req}, which neither the kit nor the image has")
            elif not req.specifier.contains(have[0], prereleases=True):
                problems.append(f"{w.name} needs {req}; the kit has {name} {have[0]}")
    total = sum(w.stat().st_size for w in wheels)
    if total > MAX_BYTES:
        problems.append(f"the kit is {total / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check the kit, download nothing")
    parser.add_argument("--dir", type=Path, default=KIT_DIR)
    args = parser.parse_args()
    if not args.check:
        download(args.dir)
    problems = check(args.dir)
    for problem in problems:
        print(f"gpu kit: {problem}", file=sys.stderr)
    if problems:
        sys.exit(1)
    wheels = sorted(args.dir.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"gpu kit: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dir}")


if __name__ == "__main__":
    main()
