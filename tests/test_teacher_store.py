"""The on-disk teacher-state store against a plain dict of what was put."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spectral.training.teacher_store import DiskStore, MemoryStore, sample_key

META = {"target": "t", "aux_layers": [1, 2, 3], "dtype": "bfloat16", "width": 8}


def rows(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_rows_read_back_exactly_in_this_and_a_later_process(tmp_path: Path) -> None:
    expected = {sample_key([s, s + 1]): rows(s, 3 + s) for s in range(5)}
    store, memory = DiskStore(tmp_path, META), MemoryStore()
    for key, value in expected.items():
        store.put(key, value)
        memory.put(key, value)
        store.put(key, rows(99, 2))  # a key already there keeps its first rows
    reopened = DiskStore(tmp_path, META)
    for key, value in expected.items():
        assert torch.equal(store.get(key), value)
        assert torch.equal(reopened.get(key), value)
        assert torch.equal(memory.get(key), value)
    assert sample_key([7, 8]) not in reopened
    assert sample_key([7, 8]) != sample_key([8, 7])


def test_a_write_cut_short_loses_only_that_sample(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, META)
    store.put("a", rows(0, 4))
    store.put("b", rows(1, 2))
    # A kill after "c"'s rows were half written, and one in the middle of its index line.
    with open(tmp_path / "states.bin", "ab") as f:
        f.write(b"\0" * 40)
    with open(tmp_path / "index.jsonl", "a") as f:
        f.write('{"key": "c", "ro')
    reopened = DiskStore(tmp_path, META)
    assert "c" not in reopened
    assert (tmp_path / "states.bin").stat().st_size == 6 * 8 * 2
    reopened.put("d", rows(2, 3))
    again = DiskStore(tmp_path, META)
    assert torch.equal(again.get("a"), rows(0, 4))
    assert torch.equal(again.get("b"), rows(1, 2))
    assert torch.equal(again.get("d"), rows(2, 3))
    assert [json.loads(line)["key"] for line in open(tmp_path / "index.jsonl")] == ["a", "b", "d"]


def test_states_of_another_target_or_shape_are_refused(tmp_path: Path) -> None:
    DiskStore(tmp_path, META).put("a", rows(0, 2))
    with pytest.raises(SystemExit, match="delete the directory"):
        DiskStore(tmp_path, {**META, "aux_layers": [2, 15, 27]})
    with pytest.raises(ValueError, match="do not fit"):
        DiskStore(tmp_path, META).put("b", torch.zeros(2, 8))  # float32 into bfloat16 rows
