"""SchedulerConfig: the limits and policies a scheduler runs by, from `ServerArgs` and the
resolved model."""

from __future__ import annotations

from dataclasses import dataclass

from spectral.args import ServerArgs
from spectral.core.model import ResolvedModel

SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_slots: int  # the worker's KV pool
    max_running_requests: int
    max_context_len: int
    max_prefill_tokens: int
    eos_token_ids: tuple[int, ...]  # the model's stop ids
    vocab_size: int
    chunked_prefill_size: int | None = None
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    grammar_compile_timeout: float = 300.0  # seconds a request waits for its grammar
    grammar_cache_bytes: int = 512 * 2**20  # compiled grammars kept
    overlap_schedule: bool = False  # plain decode steps launched ahead (DecodeOverlap)
    mixed_chunk: bool = False  # a prefill step decodes the running requests too

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be fcfs or lpm (got {self.schedule_policy!r})")

    @classmethod
    def of(cls, args: ServerArgs, model: ResolvedModel, num_kv_slots: int) -> SchedulerConfig:
        return cls(
            num_kv_slots=num_kv_slots,
            max_running_requests=args.max_running_requests,
            max_context_len=model.context_len,
            max_prefill_tokens=args.max_prefill_tokens,
            eos_token_ids=model.stop_token_ids,
            vocab_size=model.vocab_size,
            chunked_prefill_size=args.chunked_prefill_size,
            schedule_policy=args.schedule_policy,
            disable_radix_cache=args.disable_radix_cache,
            grammar_compile_timeout=args.grammar_compile_timeout,
            grammar_cache_bytes=args.grammar_cache_mib * 2**20,
            overlap_schedule=args.resolved_overlap_schedule(),
            mixed_chunk=args.enable_mixed_chunk,
        )
