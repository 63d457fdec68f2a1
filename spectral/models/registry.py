"""The architectures spectral implements, and how a model names its own: the config's
`architectures`, else its `model_type`, else it is refused; a GGUF by `general.architecture`.
Never a guess. Light to import (no torch, no transformers): the server checks a model here
before it starts its children."""

from __future__ import annotations

import json
import struct
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
    return _readable(field.contents() if field is not None else None, path)


def check_gguf(path: str | Path) -> str:
    """The architecture of the GGUF file at `path`, or refused. llama.cpp's writer puts
    `general.architecture` first, which is then read from the header alone; other files go
    through gguf's reader, which parses every metadata array (9 s for a 152k-token vocabulary)."""
    arch = architecture_in_header(path)
    if arch is None:
        import gguf

        return gguf_architecture(gguf.GGUFReader(str(path)), path)
    return _readable(arch, path)


def _readable(arch: str | None, path: str | Path) -> str:
    if arch is None:
        raise UnsupportedModelError(f"{path}: the GGUF has no general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(GGUF_ARCHITECTURES)
        )
    return arch


def architecture_in_header(path: str | Path) -> str | None:
    """The value of the header's first key where that is `general.architecture` (a string),
    else None. The layout: magic, version (u32), tensor and key counts (u64 each), then each
    key as a u64 length and bytes, its value type (u32: 8 is a string) and a string's u64
    length and bytes; little-endian."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if len(head) < 32 or head[:4] != b"GGUF":
        return None
    (key_len,) = struct.unpack_from("<Q", head, 24)
    end = 32 + key_len
    if head[32:end] != b"general.architecture" or len(head) < end + 12:
        return None
    value_type, value_len = struct.unpack_from("<IQ", head, end)
    if value_type != 8:
        return None
    return head[end + 12 : end + 12 + value_len].decode()
