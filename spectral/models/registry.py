"""The architectures spectral implements, and how a model names its own: the config's
`architectures`, else its `model_type`, else it is refused; a GGUF by `general.architecture`.
Never a guess. Light to import (no torch, no transformers): the server checks a model here
before it starts its children."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The architecture class of each model_type spectral implements.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# The GGUF architectures spectral reads (llama.cpp writes Mistral models as llama).
GGUF_ARCHITECTURES = ("llama", "qwen2")


class UnsupportedModelError(ValueError):
    pass


def _supported() -> str:
    return ", ".join(sorted(ARCHITECTURES.values()))


def architecture_of(config: Mapping[str, Any]) -> str:
    """The architecture class a HF config (as a dict) names, if spectral implements it."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if archs:
        if archs[0] not in ARCHITECTURES.values():
            raise UnsupportedModelError(
                f"architecture {archs[0]!r} is not supported; supported: {_supported()}"
            )
        return archs[0]
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    found = f"model_type {model_type!r}" if model_type else "neither architectures nor model_type"
    raise UnsupportedModelError(
        f"the model's config names no architecture spectral implements ({found}); "
        f"supported: {_supported()} (model_type {', '.join(sorted(ARCHITECTURES))})"
    )


def check_model_dir(model_dir: str | Path) -> str:
    """The architecture of the HF directory `model_dir` (from its config.json), or refused."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UnsupportedModelError(f"cannot read the model's config {path}: {err}") from err
    return architecture_of(config)


def gguf_architecture(reader: Any, path: str | Path) -> str:
    """`general.architecture` of a GGUF (a gguf.GGUFReader over `path`), if spectral reads it."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise UnsupportedModelError(f"{path}: the GGUF has no general.architecture")
    arch = field.contents()
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(GGUF_ARCHITECTURES)
        )
    return arch


def check_gguf(path: str | Path) -> str:
    """The architecture of the GGUF file at `path`, or refused (reads its header only)."""
    import gguf

    return gguf_architecture(gguf.GGUFReader(str(path)), path)
