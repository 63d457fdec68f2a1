"""Reading a GGUF's tensors without its vocabulary: what loading weights needs of the file."""

from __future__ import annotations

import struct
import sys

import gguf
import numpy as np


class WeightsReader(gguf.GGUFReader):
    """gguf's reader without the vocabulary's metadata (tokens, merges, token types), which
    loading weights never reads: gguf parses each of their items into NumPy views of its own
    (11 s of CPU for a 49k vocabulary, ~370 MB for a 152k one); here their bytes are only
    stepped over. Every other field is gguf's, parsed by gguf."""

    def _build_fields(self, offs: int, count: int) -> int:  # gguf's pass over the metadata
        view = memoryview(self.data)
        little = (self.byte_order == "I") == (sys.byteorder == "little")
        u32, u64 = struct.Struct("<I" if little else ">I"), struct.Struct("<Q" if little else ">Q")
        for _ in range(count):
            (key_len,) = u64.unpack_from(view, offs)
            key = bytes(view[offs + 8 : offs + 8 + key_len]).decode()
            if not key.startswith("tokenizer."):
                offs = super()._build_fields(offs, 1)
                continue
            (raw_type,) = u32.unpack_from(view, offs + 8 + key_len)
            offs = self._skip_value(view, offs + 12 + key_len, raw_type, u32, u64)
        return offs

    def _skip_value(
        self, view: memoryview, offs: int, raw_type: int, u32: struct.Struct, u64: struct.Struct
    ) -> int:
        """The offset past a metadata value of GGUF type `raw_type` at `offs`."""
        kind = gguf.GGUFValueType(raw_type)
        if kind == gguf.GGUFValueType.STRING:
            return offs + 8 + u64.unpack_from(view, offs)[0]
        if kind != gguf.GGUFValueType.ARRAY:
            return offs + np.dtype(self.gguf_scalar_to_np[kind]).itemsize
        ((item_type,), (count,)) = u32.unpack_from(view, offs), u64.unpack_from(view, offs + 4)
        offs += 12
        item = gguf.GGUFValueType(item_type)
        if item == gguf.GGUFValueType.STRING:  # each a length, then its bytes
            for _ in range(count):
                offs += 8 + u64.unpack_from(view, offs)[0]
            return offs
        if item != gguf.GGUFValueType.ARRAY:
            return offs + count * np.dtype(self.gguf_scalar_to_np[item]).itemsize
        for _ in range(count):
            offs = self._skip_value(view, offs, item_type, u32, u64)
        return offs
