"""Plain decode steps launched ahead of their results (the scheduler's overlap, `--disable-
overlap-schedule`): `launch` queues a step's forward and sampling on the device and returns at
once, `collect` waits for the oldest launched step's tokens. A step launched while the one
before it is still out reads that step's tokens where the device holds them: an input id
-(i + 1) is the token the previous step sampled for its row i. So the host builds step N + 1
while the device runs step N, and the device need not wait for the host between them.

Only what needs no host read inside a step goes this way: greedy or (seeded) sampled rows
without penalties, grammars or logprobs; the scheduler sends everything else through
`forward`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from spectral.core.forward import ForwardMode
from spectral.core.worker_io import MAX_LAUNCHED, WorkerBatch, WorkerResult
from spectral.worker.sampler import sample


@dataclass
class Launched:
    tokens: torch.Tensor  # [B] int64 where the step ran
    host: torch.Tensor  # [B] int64, pinned on a GPU: the tokens' copy, filled once `done`
    done: torch.cuda.Event | None  # None on a CPU (the copy has happened)


class DecodePipeline:
    def __init__(self, worker) -> None:  # a ModelWorker (its module imports this one)
        self.worker = worker
        self.launched: deque[Launched] = deque()

    @torch.inference_mode()
    def launch(self, wb: WorkerBatch) -> None:
        """Queue `wb` (a DECODE batch; negative input ids name the previous step's rows)."""
        if wb.mode != ForwardMode.DECODE:
            raise ValueError(f"only decode steps are launched ahead (got {wb.mode.name})")
        if len(self.launched) >= MAX_LAUNCHED:
            raise RuntimeError(f"{MAX_LAUNCHED} steps are out already: collect one first")
        worker = self.worker
        batch = worker.to_forward_batch(wb)
        if min(wb.input_ids) < 0:
            if not self.launched:
                raise ValueError("a step names the previous step's tokens, but none is out")
            previous = self.launched[-1].tokens
            ids = batch.input_ids
            batch.input_ids = torch.where(ids < 0, previous[(-ids - 1).clamp(min=0)], ids)
        _, _, logits = worker.forward_batch(batch)
        tokens = sample(logits, wb.sampling, None, worker.model.kernels).next_token_ids
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = tokens, None
        self.launched.append(Launched(tokens, host, done))

    def collect(self) -> WorkerResult:
        """The oldest launched step's tokens (waiting for them)."""
        if not self.launched:
            raise RuntimeError("no step was launched")
        step = self.launched.popleft()
        if step.done is not None:
            step.done.synchronize()
        tokens = step.host.tolist()
        return WorkerResult(tokens, [None] * len(tokens), [None] * len(tokens))
