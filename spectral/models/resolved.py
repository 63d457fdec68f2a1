"""resolve_model: what the model is, worked out once from `ServerArgs` (see core/model.py)."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from spectral.args import ServerArgs
from spectral.core.model import ResolvedModel
from spectral.models.config import ModelConfig
from spectral.models.registry import check_model_dir
from spectral.models.resolve import gguf_source, model_files_dir


def resolve_model(args: ServerArgs) -> tuple[ResolvedModel, Any]:
    """The model `args` name, and its tokenizer (loaded on the way: its EOS is a stop id).
    ModelNotFoundError / UnsupportedModelError say what is wrong with the path."""
    model_dir = model_files_dir(args.model_path, args.model_cache_dir)
    check_model_dir(model_dir)  # a clear refusal before transformers reads the config
    config = ModelConfig.from_pretrained(model_dir)
    tokenizer_dir = args.tokenizer_path or model_dir
    tokenizer = load_tokenizer(tokenizer_dir)
    stop_ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    gguf = gguf_source(args.model_path)
    model = ResolvedModel(
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        gguf_file=str(gguf) if gguf is not None else None,
        context_len=config.context_length(args.context_length),
        vocab_size=config.vocab_size,
        stop_token_ids=tuple(sorted(stop_ids)),
        model_type=config.hf_config.model_type,
        architecture=config.architecture,
        features=config.features(),
    )
    return model, tokenizer


def load_tokenizer(tokenizer_dir: str) -> Any:
    """The HF tokenizer in `tokenizer_dir` (each process loads its own)."""
    return AutoTokenizer.from_pretrained(tokenizer_dir)
