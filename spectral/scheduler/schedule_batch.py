"""ScheduleBatch: the requests of one step and how they become a `WorkerBatch`."""

from __future__ import annotations

from dataclasses import dataclass

from spectral.forward import ForwardMode
from spectral.scheduler.req import Req
from spectral.worker.io import RequestSampling, WorkerBatch


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]

    def to_worker_batch(self, banned_for: dict[str, list[int]]) -> WorkerBatch:
        """Every request's new tokens: the whole prompt past its cached prefix for EXTEND, the
        newest output token for DECODE. Their slots must already be in `req.kv_slots`."""
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        sampling: list[RequestSampling] = []
        for req in self.reqs:
            ids = req.all_ids
            seq_len = req.seq_len
            if self.mode == ForwardMode.EXTEND:
                prefix = 0
                new = ids[:seq_len]
            else:
                prefix = seq_len - 1
                new = [ids[seq_len - 1]]
            input_ids.extend(new)
            positions.extend(range(prefix, seq_len))
            out_loc.extend(req.kv_slots[prefix:seq_len])
            prefix_lens.append(prefix)
            extend_lens.append(seq_len - prefix)
            p = req.sampling_params
            sampling.append(
                RequestSampling(
                    params=p,
                    output_ids=req.output_ids,
                    penalty_prompt_ids=req.input_ids if p.repetition_penalty != 1.0 else [],
                    return_logprob=req.return_logprob,
                    top_logprobs_num=req.top_logprobs_num,
                    banned_token_ids=banned_for.get(req.rid, []),
                )
            )
        return WorkerBatch(
            mode=self.mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_loc,
            req_pool_indices=[req.req_pool_idx for req in self.reqs],
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            sampling=sampling,
        )
