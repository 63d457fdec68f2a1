"""The EAGLE head's inputs after the target's forwards: a plain step's batch shifted by one
token (`shifted_draft_batch`) and queued (`QueuedPositions`), a verified round's accepted
positions (`round_draft_batch`),
and the same laid out in static buffers (`ExtendGraphs`), so that the head's extend after a
round is one CUDA graph per batch size.

The static layout: request b's i-th accepted token at b * width + i. Padded tokens and padded
requests sit at the req-to-token table's dummy row (position 0, one key) and write their keys
to the dummy slot 0, which nothing real reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spectral.core.cuda_graphs import StaticGraphs
from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.transfer import on_device, stage
from spectral.speculative.drafters.graphs import smallest_holding

# extend(tokens, features, positions, slots, token_rows, last, rows): the static extend
StaticExtend = Callable[..., None]


def shifted_draft_batch(
    batch: ForwardBatch, next_tokens: list[int], mode: ForwardMode = ForwardMode.DRAFT_EXTEND
) -> ForwardBatch:
    """The head's batch for the positions `batch` computed: each request's tokens shifted left
    by one, its `next_tokens[i]` appended (position t pairs with token t + 1)."""
    if all(ext == 1 for ext in batch.extend_lens):  # a decode step: the next tokens alone
        ids = on_device(next_tokens, batch.input_ids.dtype, batch.input_ids.device)
    else:
        ids = batch.input_ids.clone()
        offset = 0
        for ext, nxt in zip(batch.extend_lens, next_tokens):
            ids[offset : offset + ext - 1] = batch.input_ids[offset + 1 : offset + ext]
            ids[offset + ext - 1] = nxt
            offset += ext
    return ForwardBatch(
        mode=mode,
        input_ids=ids,
        positions=batch.positions,
        out_cache_loc=batch.out_cache_loc,
        req_pool_indices=batch.req_pool_indices,
        prefix_lens=batch.prefix_lens,
        extend_lens=batch.extend_lens,
        rows_host=batch.rows_host,  # write_kv reads the rows there, not on the device
    )


# A target's features at some positions: a tensor [T, F], or the states of the layers a head
# captures (EAGLE-3's three), each [T, H], not yet joined (`joined`).
Features = torch.Tensor | list[torch.Tensor]


def joined(features: Features) -> torch.Tensor:
    """A target's features [T, F]: given as the captured layers' states (a list, EAGLE-3's),
    those joined along the last dimension."""
    return features if isinstance(features, torch.Tensor) else torch.cat(features, dim=-1)


class QueuedPositions:
    """Positions whose head KV is still to be computed (`EagleDrafter.write_kv`), kept as the
    steps gave them: (input ids, features, positions, slots) per step, the ids a tensor or,
    from a plain decode step, the host's list, and the features as captured (`joined`), made
    tensors once, when taken; and each queued row's last token among them (a later step's
    wins), on the host."""

    def __init__(self) -> None:
        self.parts: list[tuple] = []
        self.tokens = 0
        self.last: dict[int, int] = {}

    def add(
        self,
        ids: torch.Tensor | list[int],
        features: Features,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: list[int],
        lens: list[int],
    ) -> int:
        """Queue a batch's positions: `lens[i]` tokens of table row `rows[i]` (read on the
        host by the caller); returns the tokens queued in all."""
        self.parts.append((ids, features, positions, slots))
        for row, n in zip(rows, lens):
            self.tokens += n
            self.last[row] = self.tokens - 1
        return self.tokens

    def take(self) -> tuple[torch.Tensor, ...] | None:
        """Everything queued, emptied: (ids, features, positions, slots) concatenated, the
        rows and where their last tokens are in them, and the slots to write each position's
        KV to (a slot queued twice takes its newest: the older writes go to the dummy slot 0,
        nothing here waiting for the device); None where nothing is queued."""
        if not self.parts:
            return None
        id_parts, feature_parts, position_parts, slot_parts = zip(*self.parts)
        device = slot_parts[0].device
        if all(isinstance(part, list) for part in id_parts):
            ids = on_device([t for part in id_parts for t in part], torch.int64, device)
        else:
            ids = torch.cat(
                [
                    part if isinstance(part, torch.Tensor) else on_device(part, torch.int64, device)
                    for part in id_parts
                ]
            )
        if all(isinstance(part, list) for part in feature_parts):  # each layer's joined once
            features = torch.cat([torch.cat(layer) for layer in zip(*feature_parts)], dim=-1)
        else:
            features = torch.cat([joined(part) for part in feature_parts])
        positions, slots = torch.cat(position_parts), torch.cat(slot_parts)
        rows, last = (on_device(list(v), torch.int64, device) for v in zip(*self.last.items()))
        self.parts, self.tokens, self.last = [], 0, {}
        ordered, order = torch.sort(slots, stable=True)
        last_of_slot = torch.ones_like(ordered, dtype=torch.bool)
        last_of_slot[:-1] = ordered[1:] != ordered[:-1]
        newest = torch.empty_like(last_of_slot).scatter_(0, order, last_of_slot)
        return ids, features, positions, slots, rows, last, torch.where(newest, slots, 0)


def round_draft_batch(
    batch: ForwardBatch, prefix_lens: list[int], emitted: list[list[int]], slots: torch.Tensor
) -> ForwardBatch:
    """The head's batch after a verified round (`batch`, the verify batch): each request's
    accepted positions from prefix_lens[b] on, paired with the tokens `emitted` after them,
    at the `slots` they keep (request after request)."""
    lens = [len(tokens) for tokens in emitted]
    inputs = stage(
        {
            "input_ids": [t for tokens in emitted for t in tokens],
            "positions": [p + i for p, n in zip(prefix_lens, lens) for i in range(n)],
        },
        slots.device,
    )
    return ForwardBatch(
        mode=ForwardMode.DRAFT_EXTEND,
        input_ids=inputs["input_ids"],
        positions=inputs["positions"],
        out_cache_loc=slots,
        req_pool_indices=batch.req_pool_indices,
        prefix_lens=list(prefix_lens),
        extend_lens=lens,
        rows_host=batch.rows_host,
    )


class ExtendGraphs(StaticGraphs):
    """The head's extend over a verified round through static buffers of up to `width`
    accepted tokens a request: `extend` (reading nothing on the host) captured per batch size
    on a GPU, run eagerly through the same buffers elsewhere."""

    def __init__(
        self,
        extend: StaticExtend,
        dummy_row: int,
        batch_sizes: list[int],
        width: int,
        feature_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        super().__init__()
        self.extend = extend
        self.dummy_row = dummy_row
        self.batch_sizes = sorted(set(batch_sizes))
        self.width = width
        self.device = torch.device(device)
        largest = self.batch_sizes[-1]
        tokens = largest * width

        def ints(fill: int, n: int = tokens) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int64, device=self.device)

        self.tokens, self.positions, self.slots = ints(0), ints(0), ints(0)
        self.token_rows = ints(dummy_row)
        self.features = torch.zeros((tokens, feature_size), dtype=dtype, device=self.device)
        self.last = torch.arange(largest, device=self.device) * width  # each request's last
        self.rows = ints(dummy_row, largest)
        self.static_runs = 0  # extends that took the static path (replayed or eager)

    def inputs(self, size: int) -> tuple[torch.Tensor, ...]:
        """The buffers of batch size `size`, in `extend`'s argument order."""
        n = size * self.width
        return (
            self.tokens[:n],
            self.features[:n],
            self.positions[:n],
            self.slots[:n],
            self.token_rows[:n],
            self.last[:size],
            self.rows[:size],
        )

    @torch.inference_mode()
    def run(
        self,
        rows: list[int],
        prefix_lens: list[int],
        tokens: list[list[int]],
        slots: torch.Tensor,
        features: torch.Tensor,
    ) -> bool:
        """The extend over each request's `tokens` (the head's input ids, request after request:
        position prefix_lens[b] + i pairs features and slots there with tokens[b][i]); False,
        having done nothing, where no batch size holds the requests or a request has more
        than `width` tokens (the caller extends eagerly)."""
        real, width = len(rows), self.width
        size = smallest_holding(self.batch_sizes, real)
        if size is None or max(len(t) for t in tokens) > width:
            return False
        n = size * width
        ids, positions, token_rows = [0] * n, [0] * n, [self.dummy_row] * n
        places = []
        for b, (row, start, own) in enumerate(zip(rows, prefix_lens, tokens)):
            for i, token in enumerate(own):
                place = b * width + i
                ids[place], positions[place], token_rows[place] = token, start + i, row
                places.append(place)
        last = [b * width + len(own) - 1 for b, own in enumerate(tokens)]
        staged = stage(
            {
                "ids": ids,
                "positions": positions,
                "token_rows": token_rows,
                "places": places,
                "last": last + [b * width for b in range(real, size)],
                "rows": rows + [self.dummy_row] * (size - real),
            },
            self.device,
        )
        for name, buffer in (("ids", self.tokens), ("positions", self.positions)):
            buffer[:n].copy_(staged[name])
        self.token_rows[:n].copy_(staged["token_rows"])
        self.slots[:n].zero_()
        self.slots.index_copy_(0, staged["places"], slots)
        self.features.index_copy_(0, staged["places"], features.to(self.features.dtype))
        self.last[:size].copy_(staged["last"])
        self.rows[:size].copy_(staged["rows"])
        self.static_runs += 1
        captured = self.graphs.get(size)
        if captured is None:
            self.extend(*self.inputs(size))
        else:
            captured[0].replay()
        return True

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, in one memory pool (CUDA only), on the
        buffers as padding (what __init__ left them)."""
        runs = {
            size: (lambda size=size: self.extend(*self.inputs(size)))
            for size in reversed(self.batch_sizes)
        }
        self.capture_runs(runs, "draft extends")

    def summary(self) -> dict:
        """What /get_server_info reports under cuda_graph's `draft`, `extend`."""
        return self.summary_with(batch_sizes=self.batch_sizes, width=self.width)
