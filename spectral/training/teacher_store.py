"""Where `train-eagle3` keeps the target's states per sample, so that the target's forward runs
once per sample: in memory for one run (`MemoryStore`), or on disk for later runs over the same
data too (`DiskStore`). A key hashes a sample's token ids; a row holds the captured layers'
inputs and the final hidden state side by side ([n, 4H], the teacher's dtype).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch


def sample_key(input_ids: list[int]) -> str:
    return hashlib.blake2b(
        np.asarray(input_ids, dtype=np.int32).tobytes(), digest_size=16
    ).hexdigest()


class MemoryStore:
    """States held in this process (gone when it ends)."""

    def __init__(self) -> None:
        self.rows: dict[str, torch.Tensor] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def get(self, key: str) -> torch.Tensor:
        return self.rows[key]

    def put(self, key: str, states: torch.Tensor) -> None:
        self.rows[key] = states.clone()


class DiskStore:
    """States appended to `states.bin` (raw rows), indexed by `index.jsonl` (one line per
    sample: key, first row, row count), described by `meta.json` (what made them: the target,
    the captured layers, the dtype, the row width). A line is appended only after its rows are
    written, so a killed run loses at most the sample it was writing: rows past the last
    indexed one are cut off when the store is opened again. Reads go through the page cache."""

    def __init__(self, directory: str | Path, meta: dict) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype: torch.dtype = getattr(torch, meta["dtype"])
        self.width = int(meta["width"])
        self.row_bytes = self.width * torch.empty((), dtype=self.dtype).element_size()
        meta_file = self.dir / "meta.json"
        if meta_file.exists():
            found = json.loads(meta_file.read_text())
            if found != meta:
                raise SystemExit(
                    f"the teacher states in {self.dir} were made with {found}, not {meta}; "
                    "delete the directory or train in another --work-dir"
                )
        else:
            meta_file.write_text(json.dumps(meta, indent=1))
        self.index: dict[str, tuple[int, int]] = {}
        index_file = self.dir / "index.jsonl"
        text = index_file.read_text() if index_file.exists() else ""
        lines = text.splitlines()
        torn = bool(text) and not text.endswith("\n")
        if torn:
            lines.pop()  # cut short by a kill: that sample was never committed
        rows = 0
        for line in lines:
            entry = json.loads(line)
            self.index[entry["key"]] = (entry["row"], entry["rows"])
            rows = entry["row"] + entry["rows"]
        self.data_file = self.dir / "states.bin"
        with open(self.data_file, "ab") as f:
            if f.tell() < rows * self.row_bytes:
                raise SystemExit(f"{self.data_file} is shorter than its index; delete {self.dir}")
            f.truncate(rows * self.row_bytes)
        self.rows = rows
        if torn:  # rewritten without the torn line, so that appends start on a fresh one
            with open(index_file, "w") as f:
                f.writelines(
                    json.dumps({"key": k, "row": r, "rows": n}) + "\n"
                    for k, (r, n) in self.index.items()
                )

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def get(self, key: str) -> torch.Tensor:
        row, n = self.index[key]
        raw = np.fromfile(
            self.data_file, dtype=np.uint8, count=n * self.row_bytes, offset=row * self.row_bytes
        )
        return torch.from_numpy(raw).view(self.dtype).view(n, self.width)

    def put(self, key: str, states: torch.Tensor) -> None:
        if key in self.index:
            return
        if states.dtype != self.dtype or states.shape[-1] != self.width:
            raise ValueError(
                f"states of {states.dtype} x {states.shape[-1]} do not fit a store of "
                f"{self.dtype} x {self.width}"
            )
        n = states.shape[0]
        with open(self.data_file, "ab") as f:
            f.write(states.contiguous().view(torch.uint8).numpy().tobytes())
        with open(self.dir / "index.jsonl", "a") as f:
            f.write(json.dumps({"key": key, "row": self.rows, "rows": n}) + "\n")
        self.index[key] = (self.rows, n)
        self.rows += n
