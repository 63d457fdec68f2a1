"""ServerArgs: every flag of spectral, defined once, with one argparse for all entry points."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

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
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    disable_cpu_kernels: bool = False
    random_seed: int | None = None
    num_threads: int | None = None
    # CUDA graphs (SGLang's flags)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None
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
    speculative_lookahead_window: int | None = None
    speculative_lookahead_ngram: int | None = None
    speculative_lookahead_guesses: int | None = None
    # Server
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "info"
    api_key: str | None = None
    served_model_name: str | None = None
    # Tensor parallelism: worker ranks in one torch.distributed group
    tp_size: int = 1
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
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1 (got {self.max_prefill_tokens})")
        for name in (
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
        if self.speculative_algorithm is not None:
            SpecSettings.from_args(self)  # raises on a bad combination

    def spec_settings(self) -> SpecSettings | None:
        """The speculative-decoding settings with defaults filled in, or None when off."""
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

    def resolved_device(self) -> str:
        import torch

        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.resolved_device() == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        help_text = {
            "model_path": "HF model directory, a .gguf file, or 'default' (SmolLM2-135M-Instruct)",
            "model_cache_dir": "where a GGUF's config and tokenizer are extracted, once "
            "(default ~/.cache/spectral)",
            "tokenizer_path": "tokenizer directory (default: the model's)",
            "dtype": "auto (bf16 where native), float32, bfloat16, float16",
            "device": "auto, cpu or cuda",
            "context_length": "override the model's context length",
            "quantization": "auto or gguf: a GGUF model's blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, "
            "Q4_K, Q5_K, Q6_K) are served as they are on the CPU, expanded in registers to "
            "exactly the dequantized values; gguf-int8: the same blocks against activations "
            "quantized to 8 bits per 32, in integer dot products (faster, not exact); none: "
            "every weight dequantized at load",
            "load_format": "auto: the model's weights; dummy: random weights of the model's "
            "shape, made on the device (benchmarks of a shape without its weights; the model "
            "directory needs only config.json and a tokenizer)",
            "max_total_tokens": "KV pool size in tokens (default: from --mem-fraction-static)",
            "mem_fraction_static": "fraction of free memory given to the KV pool",
            "max_running_requests": "most requests decoding at once",
            "max_prefill_tokens": "most prompt tokens in one prefill batch",
            "chunked_prefill_size": "prefill long prompts in chunks of this many tokens",
            "schedule_policy": "fcfs (arrival order) or lpm (longest cached prefix first)",
            "disable_radix_cache": "do not share KV between requests with a common prefix",
            "attention_backend": "auto (CPU: torch; CUDA: flashinfer where installed and the "
            "dtype is bfloat16/float16, else triton), torch, triton (CUDA; on a CPU only under "
            "Triton's interpreter, for tests), flashinfer (CUDA)",
            "disable_cpu_kernels": "use plain PyTorch matmuls instead of spectral's C++ kernels",
            "random_seed": "seed for unseeded sampling",
            "disable_cuda_graph": "on a GPU, run decode and verification forwards eagerly "
            "instead of replaying CUDA graphs captured at start",
            "cuda_graph_max_bs": "largest batch captured in a CUDA graph (default: from the "
            "GPU's free memory, at most --max-running-requests); larger batches run eagerly",
            "cuda_graph_bs": "the batch sizes captured (e.g. 1 2 4 8; default: 1, 2, 3, 4, "
            "8, 12, 16, 24, then steps of 8 and 16, up to --cuda-graph-max-bs). On a CPU, "
            "given, the same static-buffer path runs without capture (how it is tested)",
            "num_threads": "CPU threads of the model worker (default: torch's, one per core)",
            "speculative_algorithm": "EAGLE, EAGLE3 (draft head), STANDALONE (draft model), "
            "MEDUSA (Medusa heads), NGRAM or LOOKAHEAD (no model)",
            "speculative_draft_model_path": "draft head directory (EAGLE/EAGLE3; 'default' for "
            "the head shipped for the default model), or the draft LM (STANDALONE: a GGUF file "
            "or HF directory with the target's tokenizer)",
            "speculative_num_steps": "draft tree depth (draft forwards per round)",
            "speculative_eagle_topk": "children kept per expanded node",
            "speculative_num_draft_tokens": "most tree nodes a request verifies per round, the "
            "root included (the planner picks fewer where they do not pay)",
            "speculative_max_batch_size": "decode plainly when more requests than this run "
            "(default: no limit but the planner's; 1 with --speculative-fixed-tree)",
            "speculative_fixed_tree": "every request verifies the full tree every round, up to "
            "--speculative-max-batch-size, instead of trees sized from the cost model",
            "speculative_disable_grammar_drafts": "do not draft the text a request's grammar "
            "forces next (JSON keys and punctuation, a regex's literals)",
            "speculative_draft_quantization": "weights of the draft's matmuls on the CPU: "
            "q8_0 (GGUF 8-bit blocks, a quarter of float32's memory traffic), q4_1 (4-bit) or "
            "none; for STANDALONE, the draft model's layers stored in more bits a weight are "
            "quantized again at load. auto: q8_0 for a head, a draft model as stored",
            "speculative_token_map": "STANDALONE: the token ids the draft model drafts from "
            "(FR-Spec; SGLang's torch.save'd tensor or a JSON list; `spectral token-map` "
            "writes one): its LM head keeps only those rows",
            "speculative_cost_model": "a cost model JSON to plan trees by instead of measuring "
            "one at start-up (cached per machine under ~/.cache/spectral/cost_models)",
            "speculative_ngram_min_match_window_size": "NGRAM: shortest suffix match that "
            "drafts (default 2)",
            "speculative_ngram_max_match_window_size": "NGRAM: longest suffix matched (default 4)",
            "speculative_hybrid_ngram": "EAGLE, EAGLE3, STANDALONE, MEDUSA: n-gram trees of up "
            "to N tokens (root included), verified instead of the drafter's tree for a request "
            "and round where the planner expects more of them (default 8; 0: the drafter "
            "drafts every round)",
            "speculative_hybrid_lookahead": "with n-gram trees beside a drafter: LOOKAHEAD's "
            "window and pool join them as a third source (the --speculative-lookahead-* flags "
            "size them)",
            "speculative_lookahead_window": "LOOKAHEAD: guessed tokens verified as a Jacobi "
            "chain each round (W, default 3)",
            "speculative_lookahead_ngram": "LOOKAHEAD: n-gram size of its pool (N, default 3)",
            "speculative_lookahead_guesses": "LOOKAHEAD: pool continuations of the root verified "
            "each round (G, default 2)",
            "speculative_hybrid_merge": "with n-gram trees: verify each one together with the "
            "head's tree (their union) instead of in its place",
            "host": "address to bind (default loopback only)",
            "port": "HTTP port",
            "log_level": "debug, info, warning, error",
            "api_key": "require 'Authorization: Bearer <key>' on every endpoint but /health",
            "served_model_name": "the model name the OpenAI API reports (default: model path)",
            "tp_size": "split the model over N worker processes (tensor parallelism over "
            "torch.distributed: gloo on CPUs, NCCL on GPUs; a GGUF's blocks cut as they load)",
            "nnodes": "machines the --tp-size ranks are spread over (each runs tp_size / "
            "nnodes of them; node 0 also serves HTTP)",
            "node_rank": "this machine's place among --nnodes (0: the server)",
            "dist_init_addr": "with --nnodes > 1: HOST:PORT of node 0, where the ranks meet "
            "(torch.distributed) and, at PORT + 1, take rank 0's batches",
            "dp_size": "run N servers (ports after --port, loopback) behind sglang-router on "
            "--host:--port (needs spectral[router])",
            "worker_urls": "servers elsewhere for the router to use too (URLs separated by "
            "commas); with --dp-size 1 only these",
            "router_policy": "how the router picks a server: cache_aware (where the prompt's "
            "prefix is cached), round_robin, power_of_two (least loaded of two), random",
            "max_request_bytes": "largest request body accepted (bytes; larger ones get a 413 "
            "before they are read)",
            "max_request_sequences": "most sequences one request may start: prompts times n",
            "max_stop_strings": "most stop strings (and most stop token ids) per request",
            "max_stop_length": "longest stop string, in characters",
            "max_rid_length": "longest request id, in characters",
            "max_top_logprobs_num": "most top logprobs per token (top_logprobs_num, logprobs, "
            "top_logprobs)",
            "fault_injection": "testing only: stages (detokenizer, scheduler, worker) that fail "
            "for requests whose id starts with fault-<stage>",
        }
        for f in fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else None
            kind = {"int": int, "float": float, "str": str}
            type_name = str(f.type).split(" ")[0].replace("| None", "").strip()
            if type_name == "bool":
                parser.add_argument(flag, action="store_true", help=help_text.get(f.name, ""))
                continue
            if type_name == "list[int]":
                parser.add_argument(
                    flag, type=int, nargs="+", default=default, help=help_text.get(f.name, "")
                )
                continue
            parser.add_argument(
                flag,
                type=kind.get(type_name, str),
                default=default,
                choices={
                    "dtype": DTYPES,
                    "quantization": QUANTIZATIONS,
                    "load_format": LOAD_FORMATS,
                    "router_policy": ROUTER_POLICIES,
                    "speculative_draft_quantization": DRAFT_QUANTIZATIONS,
                }.get(f.name),
                help=help_text.get(f.name, ""),
            )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})


def cpu_has_native_bf16() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
