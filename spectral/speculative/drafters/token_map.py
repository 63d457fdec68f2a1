"""Hot-token maps (FR-Spec): the vocabulary a draft LM drafts from, restricted to the tokens a
workload mostly uses, so the draft's LM head (for a 0.5B draft over 152k tokens, over a third of
its step) reads a fifth of its rows. Drafting is what the map restricts, never what the target
emits: a token outside the map is simply not proposed, and verification stays lossless.

A map is a file of token ids: SGLang's `--speculative-token-map` format (a tensor of ids saved
with torch.save, read here without unpickling code) or a JSON list. `spectral token-map` writes
one from text files: their tokens by frequency, then the lowest ids (BPE ranks its merges by
frequency in the tokenizer's own corpus), then the special tokens.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Iterable
from pathlib import Path

import torch

DEFAULT_SIZE = 32768


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The sorted, distinct token ids [K] of the map at `path`, each below `vocab_size`;
    ValueError says what is wrong with the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--speculative-token-map {path}: no such file")
    if path.suffix == ".json":
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"--speculative-token-map {path}: not JSON ({err})") from None
    else:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch names what it could not read
            raise ValueError(
                f"--speculative-token-map {path}: neither a JSON list nor a tensor saved with "
                f"torch.save ({err})"
            ) from None
    ids = torch.as_tensor(loaded)
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(
            f"--speculative-token-map {path}: expected a non-empty list of integer token ids "
            f"(got {ids.dtype} of shape {tuple(ids.shape)})"
        )
    ids = ids.to(torch.int64).unique()  # sorted
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(
            f"--speculative-token-map {path}: token ids must lie in [0, {vocab_size}) "
            f"(got {int(ids[0])} .. {int(ids[-1])})"
        )
    return ids


def save_token_map(ids: list[int], path: str | Path) -> None:
    """Write `ids` as a JSON list (a .json path) or, as SGLang's maps are, a tensor saved with
    torch.save."""
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps(ids))
    else:
        torch.save(torch.tensor(ids, dtype=torch.int64), path)


def build_token_map(
    texts: Iterable[str], tokenizer, vocab_size: int, size: int = DEFAULT_SIZE
) -> list[int]:
    """The `size` ids a draft should keep for text like `texts` (sorted): the tokenizer's
    special tokens, the tokens of `texts` most frequent first, then the lowest ids."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"a token map's size must lie in [1, {vocab_size}] (got {size})")
    counts: collections.Counter[int] = collections.Counter()
    texts = iter(texts)
    # A batch at a time: a fast tokenizer encodes a batch's texts in parallel.
    while batch := list(itertools.islice(texts, 64)):
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            counts.update(ids)
    special = [i for i in tokenizer.all_special_ids if i < vocab_size]
    ranked = sorted((i for i in counts if i < vocab_size), key=lambda i: (-counts[i], i))
    chosen = dict.fromkeys(special)
    for source in (ranked, range(vocab_size)):
        for token in source:
            if len(chosen) >= size:
                break
            chosen[token] = None
    return sorted(chosen)[:size]


def corpus_texts(paths: list[str], suffixes: tuple[str, ...]) -> Iterable[str]:
    """The text of each file in `paths`, and of each file under a directory there whose name
    ends in one of `suffixes`."""
    for name in paths:
        path = Path(name)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
        else:
            files = [path]
        for file in files:
            yield file.read_text(encoding="utf-8", errors="replace")
