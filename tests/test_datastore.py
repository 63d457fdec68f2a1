"""The REST datastore: built from files with the model's tokenizer, memory-mapped, and its
lookups against a scan of the documents (the longest suffix of the context that occurs, every
continuation of it, none past its document's end)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.speculative.sources.datastore import (
    SEPARATOR,
    Datastore,
    build,
    tokenizer_fingerprint,
    write,
)


def naive_lookup(docs, context, window, depth, min_len=1):
    """(length, sorted continuations) of the longest suffix of `context` found in `docs`."""
    for n in range(min(window, len(context)), min_len - 1, -1):
        pattern = context[-n:]
        conts = [
            doc[i + n : i + n + depth]
            for doc in docs
            for i in range(len(doc) - n + 1)
            if doc[i : i + n] == pattern
        ]
        if conts:
            return n, sorted(c for c in conts if c)
    return 0, []


docs_strategy = st.lists(
    st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=5
)


@settings(max_examples=150, deadline=None)
@given(
    docs=docs_strategy,
    contexts=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=8), min_size=1, max_size=4),
    window=st.integers(1, 6),
    depth=st.integers(1, 5),
    stride=st.integers(1, 5),
    width=st.integers(1, 4),
)
def test_a_lookup_finds_the_longest_suffix_and_every_continuation(
    tmp_path_factory, docs, contexts, window, depth, stride, width
):
    """Against a scan, whatever the index's stride and width (patterns longer than its width
    narrow only as far as their first tokens decide)."""
    path = tmp_path_factory.mktemp("ds")
    write(path, docs, {"tokenizer": "t"}, index_stride=stride, index_width=width)
    store = Datastore(path)
    for context in contexts:
        got = store.lookup(context, window, max_results=10_000, depth=depth)
        length, conts = naive_lookup(docs, context, window, depth)
        assert got.match_len == length
        assert sorted(got.continuations) == conts
        assert all(SEPARATOR not in c for c in got.continuations)
        few = store.lookup(context, window, max_results=2, depth=depth)
        assert len(few.continuations) <= 2 and all(c in conts for c in few.continuations)


def test_the_span_of_a_pattern_is_its_occurrences(tmp_path):
    write(tmp_path, [[1, 2, 3, 1, 2, 4], [2, 3, 1, 2]], {"tokenizer": "t"})
    store = Datastore(tmp_path)
    lo, hi = store.span([1, 2])
    starts = sorted(int(store.suffixes[r]) for r in range(lo, hi))
    assert starts == [0, 3, 9]  # documents joined with a separator after each
    lo, hi = store.span([4, 4])
    assert lo == hi


def test_lookups_map_nothing_and_hold_only_the_index(tmp_path):
    """The datastore is read through pread: after lookups none of its files is mapped into the
    process (mapped pages would count in its resident memory), and what it holds is the index,
    1/128 of the datastore at the default stride."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, 3000).tolist() for _ in range(8)]
    write(tmp_path, docs, {"tokenizer": "t"})
    store = Datastore(tmp_path)
    for doc in docs:
        found = store.lookup(doc[:40], window=16, max_results=4, depth=8)
        assert found.match_len == 16 and doc[40:48] in found.continuations
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(tmp_path) not in maps.read_text()
    assert store.index_bytes <= store.nbytes / 100


def test_build_tokenizes_files_directories_and_jsonl_with_a_manifest(tmp_path, tokenizer):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path / "src" / "skip.bin").write_bytes(b"\x00\xff")
    (tmp_path / "notes.jsonl").write_text(
        json.dumps({"text": "first record"}) + "\n\n" + json.dumps({"code": "x = 1"}) + "\n"
    )
    manifest = build(
        tokenizer,
        [str(tmp_path / "src"), str(tmp_path / "notes.jsonl")],
        tmp_path / "ds",
        model="default",
        progress=False,
    )
    assert manifest["documents"] == 3
    texts = ["def add(a, b):\n    return a + b\n", "first record", "x = 1"]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert manifest["tokens"] == sum(map(len, ids))
    assert manifest["tokenizer"] == tokenizer_fingerprint(tokenizer)
    store = Datastore(tmp_path / "ds")
    assert store.tokens.tolist() == [t for doc in ids for t in [*doc, SEPARATOR]]
    store.check_tokenizer(tokenizer)
    context = tokenizer.encode("def add(a, b):\n   ", add_special_tokens=False)
    got = store.lookup(context, window=16, max_results=4, depth=4)
    assert got.match_len == len(context)
    assert got.continuations == [ids[0][len(context) : len(context) + 4]]


def test_a_bad_record_or_source_is_refused_naming_it(tmp_path, tokenizer):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"title": "no text"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: a JSONL record needs a string field"):
        build(tokenizer, [str(tmp_path / "bad.jsonl")], tmp_path / "ds", progress=False)
    with pytest.raises(FileNotFoundError, match="missing"):
        build(tokenizer, [str(tmp_path / "missing")], tmp_path / "ds", progress=False)
    with pytest.raises(ValueError, match="is not a datastore"):
        Datastore(tmp_path)


def test_a_datastore_of_another_tokenizer_is_refused_naming_both(tmp_path, tokenizer):
    write(tmp_path, [[1, 2, 3]], {"tokenizer": "0" * 32, "model": "other-model"})
    with pytest.raises(ValueError, match="built with another tokenizer .*other-model"):
        Datastore(tmp_path).check_tokenizer(tokenizer)


def test_the_datastore_drafts_only_where_no_ngram_matches(tmp_path):
    """Beside the n-gram trees the datastore's continuations come in only where the context
    and the server's past requests matched nothing (their own drafted better on HumanEval):
    with an n-gram match the tree is the one drafted without a datastore; without one, the
    datastore's continuation is the tree."""
    from spectral.speculative.sources.ngram import NgramDrafter, NgramState

    write(tmp_path, [[1, 2, 7, 8, 9]], {"tokenizer": "t"})
    with_store = NgramDrafter(8, 4, datastore=Datastore(tmp_path))
    without = NgramDrafter(8, 4)
    repeats = [5, 1, 2, 3, 4, 6, 1, 2]  # "1 2" occurs earlier in the context: "3 4 6 1"
    state = NgramState()
    assert with_store.propose(repeats, state) == without.propose(repeats) != ([], [])
    assert (state.match_len, state.retrieved_len) == (2, 0)
    fresh = [5, 6, 1, 2]  # "1 2" only in the datastore
    assert without.propose(fresh) == ([], [])
    assert with_store.propose(fresh, state) == ([7, 8, 9], [0, 1, 2])
    assert (state.match_len, state.retrieved_len) == (0, 2)
