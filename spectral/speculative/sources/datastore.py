"""Datastore: drafts retrieved from a corpus indexed once (REST, retrieval-based speculative
decoding).

`spectral datastore build` tokenizes files, directories (outside installed packages, caches
and version control) and JSONL records with the target's
tokenizer into one array of int32 tokens (documents apart by SEPARATOR) and sorts its suffixes
(pydivsufsort); both are written as .npy files beside a manifest (tokenizer fingerprint,
sources, counts). A server memory-maps them: a lookup is a few binary searches over the
suffix array, reading only the pages it touches, and several servers share one datastore's
pages through the page cache.

A lookup takes the longest suffix of a request's tokens (at most `window`) that occurs in the
corpus and gives what followed its first `max_results` occurrences (in suffix order), each up to
`depth` tokens and never past its document's end.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1
MANIFEST = "manifest.json"
TOKENS = "tokens.npy"
SUFFIXES = "suffixes.npy"
# Between documents: larger than any token id (so it sorts last) and matched by no context.
SEPARATOR = np.iinfo(np.int32).max
# What a directory contributes: text files by their suffix (a JSONL file's records are read
# from its "text", "content" or "code" field).
TEXT_SUFFIXES = frozenset(
    ".py .pyi .md .rst .txt .c .h .cc .cpp .hpp .rs .go .java .js .ts .tsx .jsx .sh .toml "
    ".yaml .yml .json .html .css .sql".split()
)
RECORD_FIELDS = ("text", "content", "code")
WALKED_SUFFIXES = TEXT_SUFFIXES | {".jsonl"}
# Directories a walk does not enter: installed packages, caches, version control.
SKIP_DIRS = frozenset(
    "site-packages dist-packages node_modules __pycache__ .git .hg .venv venv .tox".split()
)
# Documents tokenized at once (a fast tokenizer splits a batch over threads).
ENCODE_BATCH = 64


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary (token -> id) and special tokens: what ids mean."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    blob = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def documents(sources: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(where, text) of every document under `sources`: a file is one document (a .jsonl
    file one per record), a directory its text files', recursively, in sorted order."""
    for source in sources:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"datastore source {source!r} does not exist")
        files = [path] if path.is_file() else sorted(_walk(path))
        for file in files:
            if file.suffix == ".jsonl":
                yield from _records(file)
                continue
            try:
                yield str(file), file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # not text: skipped


def _walk(root: Path) -> Iterator[Path]:
    """The text and JSONL files under `root`, outside SKIP_DIRS."""
    for path in root.iterdir():
        if path.is_dir() and not path.is_symlink():
            if path.name not in SKIP_DIRS:
                yield from _walk(path)
        elif path.is_file() and path.suffix in WALKED_SUFFIXES:
            yield path


def _records(file: Path) -> Iterator[tuple[str, str]]:
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            text = next((record[k] for k in RECORD_FIELDS if isinstance(record.get(k), str)), None)
            if text is None:
                raise ValueError(
                    f"{file}:{number}: a JSONL record needs a string field "
                    f"{', '.join(RECORD_FIELDS)} (got keys {sorted(record)[:8]})"
                )
            yield f"{file}:{number}", text


def build(
    tokenizer: Any, sources: list[str], output: str | Path, model: str = "", progress: bool = True
) -> dict:
    """Tokenize `sources` into a datastore at `output` (a directory); returns its manifest."""
    from tqdm import tqdm

    start = time.perf_counter()
    docs: list[np.ndarray] = []  # int32 arrays: a corpus as Python ints would take 36 B a token
    batch: list[str] = []
    found = tqdm(documents(sources), desc="tokenizing", unit=" docs", disable=not progress)
    for _, text in found:
        batch.append(text)
        if len(batch) == ENCODE_BATCH:
            docs += _encode(tokenizer, batch)
            batch = []
    docs += _encode(tokenizer, batch)
    if not docs:
        raise ValueError(f"no text found under {', '.join(sources)}")
    manifest = {
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "model": model,
        "sources": [str(Path(s).resolve()) for s in sources],
    }
    manifest = write(output, docs, manifest)
    manifest["build_seconds"] = round(time.perf_counter() - start, 1)
    (Path(output) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _encode(tokenizer: Any, texts: list[str]) -> list[np.ndarray]:
    """The non-empty documents' token ids, as int32 arrays."""
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(doc, dtype=np.int32) for doc in ids if doc]


def write(output: str | Path, docs: Sequence[Sequence[int]], manifest: dict) -> dict:
    """Write documents of token ids as a datastore at `output` (a directory) with `manifest`'s
    fields (the tokenizer's fingerprint among them); returns the whole manifest."""
    from pydivsufsort import divsufsort

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[np.ndarray] = []
    for ids in docs:
        parts += [np.asarray(ids, dtype=np.int32), np.array([SEPARATOR], dtype=np.int32)]
    tokens = np.concatenate(parts)
    # Non-negative int32 tokens sort as their uint32 view does: the lookups compare as ints.
    suffixes = np.asarray(divsufsort(tokens.view(np.uint32)))
    suffixes = suffixes.astype(np.int32 if len(tokens) < 2**31 else np.int64)
    np.save(out / TOKENS, tokens)
    np.save(out / SUFFIXES, suffixes)
    manifest = {
        "format": FORMAT,
        **manifest,
        "documents": len(docs),
        "tokens": int(len(tokens) - len(docs)),
        "bytes": (out / TOKENS).stat().st_size + (out / SUFFIXES).stat().st_size,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


@dataclass
class Retrieved:
    """What a lookup found: the suffix length matched and each occurrence's continuation."""

    match_len: int
    continuations: list[list[int]]


class Datastore:
    """A built datastore, memory-mapped (read-only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise ValueError(
                f"{path} is not a datastore (no {MANIFEST}; `spectral datastore build` makes one)"
            )
        self.manifest = json.loads(manifest.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(
                f"datastore {path} has format {self.manifest.get('format')!r}; this spectral "
                f"reads format {FORMAT} (build it again)"
            )
        self.tokens = np.load(self.path / TOKENS, mmap_mode="r")
        self.suffixes = np.load(self.path / SUFFIXES, mmap_mode="r")
        if len(self.tokens) != len(self.suffixes):
            raise ValueError(f"datastore {path}: tokens and suffixes differ in length")
        # The same pages for lookups: a memoryview reads an element or a slice several times
        # faster than NumPy indexing.
        self._tokens = memoryview(np.asarray(self.tokens))
        self._suffixes = memoryview(np.asarray(self.suffixes))

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.suffixes.nbytes

    def check_tokenizer(self, tokenizer: Any) -> None:
        """ValueError where the datastore was built with another tokenizer (its ids would mean
        other text)."""
        served = tokenizer_fingerprint(tokenizer)
        if served != self.manifest["tokenizer"]:
            raise ValueError(
                f"datastore {self.path} was built with another tokenizer (fingerprint "
                f"{self.manifest['tokenizer']}, model {self.manifest.get('model') or '?'}) than "
                f"the served model's ({served}); build it with this model's"
            )

    def span(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi): the suffixes (by rank) that start with `pattern`."""
        first = self._first(pattern)
        return first, self._past(pattern, first)

    def _first(self, pattern: list[int]) -> int:
        """The rank of the first suffix >= `pattern`."""
        n = len(pattern)
        lo, hi = 0, len(self.suffixes)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._prefix(mid, n) < pattern:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _past(self, pattern: list[int], lo: int) -> int:
        """The rank of the first suffix from `lo` whose first tokens are > `pattern`."""
        n = len(pattern)
        hi = len(self.suffixes)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._prefix(mid, n) <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _occurs_from(self, pattern: list[int]) -> int | None:
        """The rank of `pattern`'s first occurrence, or None where it does not occur."""
        first = self._first(pattern)
        if first < len(self.suffixes) and self._prefix(first, len(pattern)) == pattern:
            return first
        return None

    def _prefix(self, rank: int, n: int) -> list[int]:
        start = self._suffixes[rank]
        return self._tokens[start : start + n].tolist()

    def lookup(
        self, context: list[int], window: int, max_results: int, depth: int, min_len: int = 1
    ) -> Retrieved:
        """The continuations of the longest suffix of `context` (min_len..window tokens) found
        in the corpus; an empty Retrieved where none is."""
        best, first = 0, 0
        lo_len, hi_len = min_len, min(window, len(context))
        while lo_len <= hi_len:  # a suffix that occurs has every shorter one occurring too
            mid = (lo_len + hi_len) // 2
            found = self._occurs_from(context[-mid:])
            if found is not None:
                best, first = mid, found
                lo_len = mid + 1
            else:
                hi_len = mid - 1
        if not best:
            return Retrieved(0, [])
        last = self._past(context[-best:], first)
        out = []
        for rank in range(first, min(last, first + max_results)):
            start = self._suffixes[rank] + best
            cont = self._tokens[start : start + depth].tolist()
            if SEPARATOR in cont:
                cont = cont[: cont.index(SEPARATOR)]
            if cont:
                out.append(cont)
        return Retrieved(best, out)
