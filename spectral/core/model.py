"""ResolvedModel: what the model is (its files, context length, vocabulary, stop ids), worked
out once from `ServerArgs` by `spectral.models.resolved.resolve_model` and handed down: to every
server process as its first message, and to every layer as arguments. Nothing below
reads the config or the tokenizer's files again to find these out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResolvedModel:
    model_dir: str  # config and tokenizer files (and the weights, unless a GGUF has them)
    tokenizer_dir: str
    gguf_file: str | None  # the weights' GGUF file, when the model is one
    context_len: int  # the context served (--context-length, else the model's)
    vocab_size: int
    stop_token_ids: tuple[int, ...]  # the model's EOS ids and the tokenizer's
    model_type: str
    architecture: str
    features: dict[str, Any]  # what of its architecture it uses (/get_model_info)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # lists on the wire
