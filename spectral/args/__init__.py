"""ServerArgs: every flag of spectral, defined once, with one argparse for all entry points."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from spectral.args.help import HELP
from spectral.speculative.settings import DRAFT_QUANTIZATIONS, SpecSettings

if TYPE_CHECKING:
    import torch


ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "gguf", "gguf-int8", "none")
LOAD_FORMATS = ("auto", "dummy")
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass
class ServerArgs:
    # Model
    model_path: str = "default"
    model_cache_dir: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    quantization: str = "auto"
    load_format: str = "auto"
    # Memory and scheduling
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.25
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int | None = None
    schedule_policy: str = "fcfs"
    # A prefill step also decodes the running requests (SGLang's flag)
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    disable_cpu_kernels: bool = False
    random_seed: int | None = None
    num_threads: int | None = None
    # CUDA graphs (SGLang's flags)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None
    # Plain decode steps launched ahead of their results: SGLang's flag, and spectral's to turn
    # it on where it is off by default (a CPU)
    disable_overlap_schedule: bool = False
    enable_overlap_schedule: bool = False
    # Speculative decoding
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_max_batch_size: int | None = None
    speculative_ngram_min_match_window_size: int | None = None
    speculative_ngram_max_match_window_size: int | None = None
    speculative_hybrid_ngram: int | None = None
    speculative_hybrid_merge: bool = False
    speculative_hybrid_lookahead: bool = False
    speculative_fixed_tree: bool = False
    speculative_disable_grammar_drafts: bool = False
    speculative_draft_quantization: str = "auto"
    speculative_cost_model: str | None = None
    speculative_token_map: str | None = None
    speculative_datastore: str | None = None
    speculative_lookahead_window: int | None = None
    speculative_lookahead_ngram: int | None = None
    speculative_lookahead_guesses: int | None = None
    # Server
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "info"
    api_key: str | None = None
    served_model_name: str | None = None
    stream_interval: int = 1
    # Tensor parallelism: worker ranks in one torch.distributed group
    tp_size: int = 1
    worker_process: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Data parallelism: several servers behind sglang-router
    dp_size: int = 1
    worker_urls: str | None = None
    router_policy: str = "cache_aware"
    # Request limits (what one request may ask for; see RequestLimits)
    max_request_bytes: int = 16 * 2**20
    max_request_sequences: int = 256
    max_stop_strings: int = 32
    max_stop_length: int = 256
    max_rid_length: int = 256
    max_top_logprobs_num: int = 20
    grammar_compile_timeout: float = 300.0
    grammar_cache_mib: int = 512
    # Testing only: stages that fail on purpose (see spectral.faults)
    fault_injection: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} "
                f"(got {self.quantization!r})"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)} (got {self.load_format!r})"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda (got {self.device!r})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} "
                f"(got {self.attention_backend!r})"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1 (got {self.max_total_tokens})")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1) (got {self.mem_fraction_static})"
            )
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1 (got {self.max_running_requests})")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(
                f"chunked_prefill_size must be >= 1 (got {self.chunked_prefill_size}); "
                "leave it unset to prefill whole prompts"
            )
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm (got {self.schedule_policy!r})")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 (got {self.num_threads})")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1 (got {self.cuda_graph_max_bs})")
        if self.cuda_graph_bs is not None and (
            not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1
        ):
            raise ValueError(f"cuda_graph_bs must list batch sizes >= 1 (got {self.cuda_graph_bs})")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0 seconds (got {self.grammar_compile_timeout})"
            )
        if self.grammar_cache_mib < 0:
            raise ValueError(f"grammar_cache_mib must be >= 0 (got {self.grammar_cache_mib})")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1 (got {self.max_prefill_tokens})")
        for name in (
            "stream_interval",
            "max_request_bytes",
            "max_request_sequences",
            "max_stop_strings",
            "max_stop_length",
            "max_rid_length",
            "max_top_logprobs_num",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1 (got {self.dp_size})")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1 (got {self.tp_size})")
        self._check_nodes()
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router_policy must be one of {', '.join(ROUTER_POLICIES)} "
                f"(got {self.router_policy!r})"
            )
        if self.fault_injection is not None:
            from spectral import faults

            faults.parse_stages(self.fault_injection)  # raises on an unknown stage
        if self.speculative_datastore and not self.speculative_algorithm:
            self.speculative_algorithm = "REST"  # a datastore alone drafts by itself
        _ = self.spec  # raises on a bad combination

    @functools.cached_property
    def spec(self) -> SpecSettings | None:
        """The speculative-decoding settings with defaults filled in, or None when off:
        resolved once, here, and handed to the worker and the scheduler."""
        return SpecSettings.from_args(self) if self.speculative_algorithm else None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)

    def _check_nodes(self) -> None:
        """--nnodes, --node-rank and --dist-init-addr: the tensor-parallel ranks spread evenly
        over the machines, rank 0's reachable at HOST:PORT (and PORT + 1)."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in 0..nnodes-1 and nnodes >= 1 (got node_rank "
                f"{self.node_rank}, nnodes {self.nnodes})"
            )
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes}): each "
                "machine runs tp_size / nnodes ranks"
            )
        if self.nnodes > 1:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    "nnodes > 1 needs --dist-init-addr HOST:PORT, the address of node 0 that "
                    f"every machine can reach (got {self.dist_init_addr!r})"
                )
            if self.dp_size > 1:
                raise ValueError("--nnodes > 1 runs one server; it does not go with --dp-size")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def worker_in_own_process(self) -> bool:
        """Whether a server's model worker runs in a process of its own (with --tp-size > 1,
        rank 0 of the group; else only with --worker-process) instead of in the scheduler's."""
        return self.worker_process or self.tp_size > 1

    def resolved_device(self) -> str:
        import torch

        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_overlap_schedule(self) -> bool:
        """Whether plain decode steps launch ahead: by default on a GPU (where the host's work
        between steps leaves the device idle), not on a CPU (where the step is the host's)."""
        if self.disable_overlap_schedule:
            return False
        return self.enable_overlap_schedule or self.resolved_device().startswith("cuda")

    def resolved_dtype(self, gguf: bool) -> torch.dtype:
        """What --dtype means for a model that is (`gguf`) or is not a GGUF file: auto is
        bfloat16 on a GPU (float16 where it has none); on a CPU float32 for a GGUF served
        through the integer path (its activations go into the matmuls quantized to 8 bits
        anyway, and in bfloat16 the rest of a forward cost more: the default model's decode
        1.11x and a verify of 8 tokens 1.43x the time in float32, the 1.5B's 1.22x and
        1.47x, on an AMD EPYC with native bfloat16), else bfloat16 where the CPU has it
        natively, else float32."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.resolved_device() == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if self.resolved_quantization(gguf) == "gguf-int8":
            return torch.float32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32

    def resolved_quantization(self, gguf: bool) -> str:
        """What --quantization means for a model that is (`gguf`) or is not a GGUF file: auto
        serves a GGUF on a CPU with the CPU kernels through the integer path (gguf-int8, as
        llama.cpp does: faster, perplexity within 1%), a GGUF elsewhere from its blocks (gguf)
        and a HF directory as stored (none)."""
        if self.quantization != "auto":
            return self.quantization
        if not gguf:
            return "none"
        if self.resolved_device() == "cpu" and not self.disable_cpu_kernels:
            return "gguf-int8"
        return "gguf"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Every field as a flag (`--model-path` for model_path), in HELP's groups."""
        by_name = {f.name: f for f in fields(ServerArgs)}
        for group, helps in HELP.items():
            section = parser.add_argument_group(group)
            for name, text in helps.items():  # argparse formats help with % (escaped)
                _add_flag(section, by_name[name], text.replace("%", "%%"))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})


CHOICES = {
    "dtype": DTYPES,
    "quantization": QUANTIZATIONS,
    "load_format": LOAD_FORMATS,
    "router_policy": ROUTER_POLICIES,
    "speculative_draft_quantization": DRAFT_QUANTIZATIONS,
}


def _add_flag(parser: Any, f: dataclasses.Field, text: str) -> None:
    """The flag of field `f`: a switch for a bool, several ints for a list of them, else one
    value of the field's type (its choices where it has a fixed set)."""
    flag = "--" + f.name.replace("_", "-")
    default = f.default if f.default is not dataclasses.MISSING else None
    type_name = str(f.type).split(" ")[0].replace("| None", "").strip()
    if type_name == "bool":
        parser.add_argument(flag, action="store_true", help=text)
    elif type_name == "list[int]":
        parser.add_argument(flag, type=int, nargs="+", default=default, help=text)
    else:
        kind = {"int": int, "float": float, "str": str}.get(type_name, str)
        parser.add_argument(
            flag, type=kind, default=default, choices=CHOICES.get(f.name), help=text
        )


def cpu_has_native_bf16() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
