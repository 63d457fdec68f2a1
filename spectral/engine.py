"""Engine: the offline entry point. Same scheduler and worker as the server, in one process."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from typing import Any

import torch
from transformers import AutoTokenizer

from spectral.args import ServerArgs
from spectral.models.config import ModelConfig
from spectral.models.resolve import resolve_model_path
from spectral.sampling_params import InvalidRequestError, SamplingParams
from spectral.scheduler.req import Req
from spectral.scheduler.scheduler import Scheduler
from spectral.worker.model_worker import ModelWorker

logger = logging.getLogger(__name__)

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None


class Engine:
    """`Engine(model_path="default", dtype="auto", **server_args)`; see `ServerArgs` for options."""

    def __init__(self, model_path: str = "default", dtype: str = "auto", **kwargs: Any) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_path, dtype=dtype, **kwargs)
        args = self.args
        if args.random_seed is not None:
            torch.manual_seed(args.random_seed)
        self.model_dir = resolve_model_path(args.model_path, args.model_cache_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or self.model_dir)
        config = ModelConfig.from_pretrained(self.model_dir)
        self.context_len = args.context_length or config.max_context_len
        self.worker = ModelWorker(
            self.model_dir,
            dtype=args.resolved_dtype(),
            device=args.resolved_device(),
            max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            max_running_requests=args.max_running_requests,
            max_context_len=self.context_len,
            attention_backend=args.attention_backend,
            use_cpu_kernels=not args.disable_cpu_kernels,
        )
        self.model_config = self.worker.config
        self.scheduler = Scheduler(
            self.worker,
            self.tokenizer,
            num_kv_slots=self.worker.num_kv_slots,
            max_running_requests=args.max_running_requests,
            max_context_len=self.context_len,
            max_prefill_tokens=args.max_prefill_tokens,
            eos_token_ids=self._eos_ids(config),
            vocab_size=config.vocab_size,
        )
        self._rid_counter = itertools.count()

    def _eos_ids(self, config: ModelConfig) -> tuple[int, ...]:
        ids = set(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: InputIds = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a list of prompts run as one batch (a list)."""
        reqs, single = self._make_reqs(
            prompt, input_ids, sampling_params, return_logprob, top_logprobs_num
        )
        for req in reqs:
            self.scheduler.add_request(req)
        try:
            while not all(r.finished for r in reqs):
                self.scheduler.step()
        except BaseException:
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        outputs = [self._output(req) for req in reqs]
        return outputs[0] if single else outputs

    def _make_reqs(
        self,
        prompt: Prompt,
        input_ids: InputIds,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        return_logprob: bool,
        top_logprobs_num: int,
    ) -> tuple[list[Req], bool]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError("prompt must be a string or a list of strings")
            if not texts:
                raise InvalidRequestError("the prompt list is empty")
            if any(t == "" for t in texts):
                raise InvalidRequestError("the prompt is empty: give a non-empty text or input_ids")
            token_lists = [self.tokenizer(t)["input_ids"] for t in texts]
        else:
            single = not input_ids or isinstance(input_ids[0], int)
            token_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
            for ids in token_lists:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise InvalidRequestError(
                        "input_ids must be a list of integers (or a list of such lists)"
                    )
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(token_lists):
                raise InvalidRequestError(
                    f"{len(sampling_params)} sampling_params for {len(token_lists)} prompts"
                )
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params) for _ in token_lists]
        if top_logprobs_num < 0:
            raise InvalidRequestError(f"top_logprobs_num must be >= 0 (got {top_logprobs_num})")
        reqs = [
            Req(
                rid=f"{uuid.uuid4().hex[:8]}-{next(self._rid_counter)}",
                input_ids=ids,
                sampling_params=p,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
            )
            for ids, p in zip(token_lists, params)
        ]
        return reqs, single

    def _output(self, req: Req) -> dict[str, Any]:
        p = req.sampling_params
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
        if req.stop_text_cut is not None:
            text = text[: req.stop_text_cut]
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "finish_reason": req.finished_reason.to_dict() if req.finished_reason else None,
            "e2e_latency": (req.finished_at or time.perf_counter()) - req.created_at,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                (lp, tok, None) for lp, tok in zip(req.output_logprobs, req.output_ids)
            ]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [(lp, tok, None) for lp, tok in step] for step in req.output_top_logprobs
            ]
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    def get_server_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "model_path": self.args.model_path,
            "context_length": self.context_len,
            "memory": {
                "total_tokens": s.allocator.num_slots,
                "free_tokens": s.allocator.free_count,
            },
            "requests": {"running": len(s.running), "waiting": len(s.waiting)},
        }

    def shutdown(self) -> None:
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(req.rid)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
