"""Datastore: drafts retrieved from a corpus indexed once (REST, retrieval-based speculative
decoding).

`spectral datastore build` tokenizes files, directories (outside installed packages, caches
and version control) and JSONL records with the target's
tokenizer into one array of int32 tokens (documents apart by SEPARATOR) and sorts its suffixes
(pydivsufsort); both are written as .npy files beside a manifest (tokenizer fingerprint,
sources, counts) and a sampled index: the first tokens of every `index_stride`-th suffix. A
server holds only the index in memory and reads the rest through `pread`: a lookup's binary
searches narrow to one stride in the index, then read the few entries they compare, so nothing
of the datastore is mapped into the process (its resident memory grows by the index alone,
1/128 of the datastore by default) and several servers share its pages through the page cache.

A lookup takes the longest suffix of a request's tokens (at most `window`) that occurs in the
corpus and gives what followed its first `max_results` occurrences (in suffix order), each up to
`depth` tokens and never past its document's end.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 2
MANIFEST = "manifest.json"
TOKENS = "tokens.npy"
SUFFIXES = "suffixes.npy"
INDEX = "index.npy"
# The index: every INDEX_STRIDE-th suffix's first INDEX_WIDTH tokens (64 bytes for 1,024
# suffixes of 8 bytes each); patterns up to INDEX_WIDTH long narrow to one stride in it.
INDEX_STRIDE = 1024
INDEX_WIDTH = 16
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


def write(
    output: str | Path,
    docs: Sequence[Sequence[int]],
    manifest: dict,
    index_stride: int = INDEX_STRIDE,
    index_width: int = INDEX_WIDTH,
) -> dict:
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
    np.save(out / INDEX, sampled_index(tokens, suffixes, index_stride, index_width))
    manifest = {
        "format": FORMAT,
        **manifest,
        "documents": len(docs),
        "tokens": int(len(tokens) - len(docs)),
        "index_stride": index_stride,
        "bytes": sum((out / name).stat().st_size for name in (TOKENS, SUFFIXES, INDEX)),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def sampled_index(tokens: np.ndarray, suffixes: np.ndarray, stride: int, width: int) -> np.ndarray:
    """[ceil(n / stride), width] int32: the first `width` tokens of every `stride`-th suffix,
    -1 past the corpus's end (below every token, as a shorter suffix sorts)."""
    if stride < 1 or width < 1:
        raise ValueError(f"an index takes a stride and a width of at least 1 ({stride}, {width})")
    padded = np.concatenate([tokens, np.full(width, -1, np.int32)])
    starts = suffixes[::stride].astype(np.int64)
    return padded[starts[:, None] + np.arange(width)]


class _Column:
    """A 1-D .npy array read through `pread`: nothing of it mapped into the process."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }[version]
            shape, _, dtype = header(f)
            self.offset = f.tell()
        if len(shape) != 1 or dtype.kind != "i" or dtype.byteorder == ">":
            raise ValueError(f"{path}: not a 1-D little-endian integer array ({dtype}, {shape})")
        self.size, self.itemsize = shape[0], dtype.itemsize
        self.code = {4: "i", 8: "q"}[dtype.itemsize]
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def read(self, start: int, count: int) -> list[int]:
        """Elements start..start + count (fewer at the end)."""
        count = min(count, self.size - start)
        if count <= 0:
            return []
        data = os.pread(self.fd, count * self.itemsize, self.offset + start * self.itemsize)
        return memoryview(data).cast(self.code).tolist()

    def at(self, i: int) -> int:
        data = os.pread(self.fd, self.itemsize, self.offset + i * self.itemsize)
        return int.from_bytes(data, "little", signed=True)


@dataclass
class Retrieved:
    """What a lookup found: the suffix length matched and each occurrence's continuation."""

    match_len: int
    continuations: list[list[int]]


class Datastore:
    """A built datastore: its sampled index in memory, the rest read through `pread`."""

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
        self._tokens = _Column(self.path / TOKENS)
        self._suffixes = _Column(self.path / SUFFIXES)
        self.size = self._suffixes.size
        if self._tokens.size != self.size:
            raise ValueError(f"datastore {path}: tokens and suffixes differ in length")
        index = np.load(self.path / INDEX)
        self.stride = int(self.manifest["index_stride"])
        if index.ndim != 2 or len(index) != -(-self.size // self.stride):
            raise ValueError(f"datastore {path}: its index does not match its suffixes")
        self.index_bytes = index.nbytes
        self.samples, self.width = index.shape
        # a flat memoryview reads a row's slice several times faster than NumPy indexing
        self._index = memoryview(np.ascontiguousarray(index, np.int32).reshape(-1))

    @property
    def nbytes(self) -> int:
        """The datastore's size on disk (what is read from, not what is resident)."""
        return self.manifest["bytes"]

    @property
    def tokens(self) -> np.ndarray:
        """The corpus's tokens, memory-mapped (to inspect it; lookups do not map it)."""
        return np.load(self.path / TOKENS, mmap_mode="r")

    @property
    def suffixes(self) -> np.ndarray:
        """The suffix array, memory-mapped (as `tokens`)."""
        return np.load(self.path / SUFFIXES, mmap_mode="r")

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
        lo, hi = self._narrow(pattern, past=False)
        n = len(pattern)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._prefix(mid, n) < pattern:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _past(self, pattern: list[int], lo: int) -> int:
        """The rank of the first suffix from `lo` whose first tokens are > `pattern`."""
        start, hi = self._narrow(pattern, past=True)
        lo, n = max(lo, start), len(pattern)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._prefix(mid, n) <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _narrow(self, pattern: list[int], past: bool) -> tuple[int, int]:
        """[lo, hi] holding the rank of the first suffix >= `pattern` (past: > `pattern`), from
        the index alone. A sample whose first m = min(len, width) tokens are below the
        pattern's is below the pattern and one above is above it; one equal to them is equal
        to the pattern where m is its length, undecided where the pattern is longer."""
        m = min(len(pattern), self.width)
        key, exact = pattern[:m], m == len(pattern)
        below = self._samples_before(key, inclusive=False)
        upto = below if exact and not past else self._samples_before(key, inclusive=True)
        # the samples known to be before the answer, and the first one known to be at or after it
        before = upto if past and exact else below
        after = below if exact and not past else upto
        lo = 0 if before == 0 else (before - 1) * self.stride + 1
        return lo, min(after * self.stride, self.size)

    def _samples_before(self, key: list[int], inclusive: bool) -> int:
        """How many samples have first tokens < `key` (inclusive: <=)."""
        lo, hi, m, w = 0, self.samples, len(key), self.width
        while lo < hi:
            mid = (lo + hi) // 2
            sample = self._index[mid * w : mid * w + m].tolist()
            if sample < key or (inclusive and sample == key):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _occurs_from(self, pattern: list[int]) -> int | None:
        """The rank of `pattern`'s first occurrence, or None where it does not occur."""
        first = self._first(pattern)
        if first < self.size and self._prefix(first, len(pattern)) == pattern:
            return first
        return None

    def _prefix(self, rank: int, n: int) -> list[int]:
        return self._tokens.read(self._suffixes.at(rank), n)

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
        for start in self._suffixes.read(first, min(last - first, max_results)):
            cont = self._tokens.read(start + best, depth)
            if SEPARATOR in cont:
                cont = cont[: cont.index(SEPARATOR)]
            if cont:
                out.append(cont)
        return Retrieved(best, out)
