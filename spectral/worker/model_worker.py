"""ModelWorker: loads the model, owns the KV tensors, runs one forward per `WorkerBatch`."""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from spectral.attention.registry import create_attention_backend
from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.transfer import stage, to_device
from spectral.core.worker_io import WorkerBatch, WorkerResult
from spectral.kernels.cpu_kernels import load_cpu_kernels
from spectral.layers.linear import weight_bytes, weight_tensors
from spectral.layers.parallel import TensorParallel
from spectral.layers.routing import route_to_cpu_kernels
from spectral.mem.kv_pool import KVPool
from spectral.mem.process import eager_release, report_huge_pages
from spectral.mem.req_to_token import ReqToTokenPool
from spectral.mem.weights import gather
from spectral.models.config import ModelConfig
from spectral.models.gguf_native import load_gguf_model
from spectral.models.loader import build_model, dummy_model, load_model
from spectral.models.tensor_parallel import llama_shares, shard_llama
from spectral.worker.graph_runner import GraphRunner, plan_buckets
from spectral.worker.pipeline import DecodePipeline
from spectral.worker.sampler import sample

logger = logging.getLogger(__name__)


def free_memory_bytes(device: str) -> int:
    """Free accelerator memory, or for the CPU the system's available memory (MemAvailable),
    within what the process's cgroup still allows where it sets a limit (cgroup v2)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    available = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        raise RuntimeError("cannot read available memory; pass --max-total-tokens")
    left = cgroup_memory_left()
    return available if left is None else min(available, left)


# cgroup v1 writes "no limit" as a number near 2**63.
NO_CGROUP_LIMIT = 2**60


def cgroup_memory_left(
    root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup"
) -> int | None:
    """The memory limit less the usage of this process's cgroup (v1's memory controller, else
    v2's; `membership` lists its cgroups), or None where neither sets a limit."""
    try:
        with open(membership) as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    places = [
        (f"{root}/memory{path}", "memory.limit_in_bytes", "memory.usage_in_bytes")
        for _, controllers, path in lines
        if "memory" in controllers.split(",")
    ]
    places += [
        (f"{root}{path}", "memory.max", "memory.current")
        for _, controllers, path in lines
        if controllers == ""
    ]
    for base, limit_file, usage_file in places:
        try:
            with open(f"{base.rstrip('/')}/{limit_file}") as f:
                limit = f.read().strip()
            with open(f"{base.rstrip('/')}/{usage_file}") as f:
                used = int(f.read())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= NO_CGROUP_LIMIT:
            return None
        return max(int(limit) - used, 0)
    return None


def pool_tokens(
    asked: int | None, per_token: int, device: str, mem_fraction: float, context_len: int
) -> int:
    """The KV pool's tokens: `asked`, or what `mem_fraction` of the free memory holds (at
    least a context's worth); RuntimeError naming the sizes where that does not fit."""
    free = free_memory_bytes(device)
    if asked is not None:
        KVPool.check_fits(asked, per_token, free, f"of {device} memory is free")
        return asked
    tokens = int(free * mem_fraction) // per_token  # fits: mem_fraction < 1
    if tokens < context_len:
        raise RuntimeError(
            f"only {tokens} tokens of KV cache fit in memory, fewer than the context length "
            f"{context_len}; free memory or raise --mem-fraction-static"
        )
    return tokens


class ModelWorker:
    cost_model = None  # no speculation here (the Worker interface's optional parts)
    grammars = None
    graphs: GraphRunner | None = None  # decode and verify through static buffers (use_graphs)

    def __init__(
        self,
        model_dir: str,
        dtype: torch.dtype,
        device: str,
        max_total_tokens: int | None,
        max_running_requests: int,
        max_context_len: int,
        mem_fraction_static: float = 0.25,
        attention_backend: str = "auto",
        use_cpu_kernels: bool = True,
        gguf_file: str | None = None,
        gguf_native: bool = True,
        gguf_int8: bool = False,
        dummy_weights: bool = False,
        tensor_parallel: TensorParallel | None = None,
        quantize: str | None = None,
    ) -> None:
        """The KV pool holds `max_total_tokens` tokens, or what `mem_fraction_static` of the
        memory still free after loading the weights allows. With `gguf_file`, the weights come
        from that file (`model_dir` holds its config): with `gguf_native` and the CPU kernels
        its blocks are served as they are (with `gguf_int8`, through the integer path), else
        dequantized at load. With `tensor_parallel`, this process is one rank: it holds its
        share of the weights (a GGUF's blocks cut as they load) and of the KV heads, and its
        collectives join the other ranks'. With `dummy_weights`, the weights are random, made on
        `device` (`model_dir` needs only its config). With `quantize` (a GGUF block format, e.g.
        "Q4_1") and the CPU kernels, the layers' matmul weights in more bits a weight are
        quantized to it at load (a draft model's: it only proposes)."""
        self.device = device
        self.pipeline = DecodePipeline(self)  # plain decode steps launched ahead
        self.dtype = dtype
        kernels = load_cpu_kernels() if device == "cpu" and use_cpu_kernels else None
        self.config = ModelConfig.from_pretrained(model_dir)  # what the model is built from
        with eager_release():  # the load's temporaries go back to the system as freed
            self.model = self._load(
                model_dir,
                kernels,
                gguf_file,
                gguf_native,
                gguf_int8,
                dummy_weights,
                tensor_parallel,
                quantize,
            )
            gather(weight_tensors(self.model, buffers=True))  # off 4 KiB pages (mem/weights.py)
        # what this process's layers and KV pool hold
        shares = self.model.shares
        cfg: ModelConfig = shares.config(self.config) if shares is not None else self.config
        if tensor_parallel is not None:
            logger.info(
                "tensor-parallel rank %d of %d holds %.1f MiB of weights",
                tensor_parallel.rank,
                tensor_parallel.world,
                weight_bytes(self.model) / 2**20,
            )
        per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        max_total_tokens = pool_tokens(
            max_total_tokens, per_token, device, mem_fraction_static, max_context_len
        )
        self.num_kv_slots = max_total_tokens
        logger.info(
            "KV pool: %d tokens (%.1f MiB, committed at start)",
            max_total_tokens,
            max_total_tokens * per_token / 2**20,
        )
        self.kv_pool = KVPool(
            max_total_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, device
        )
        if device == "cpu":
            report_huge_pages(logger)
        self.req_to_token = ReqToTokenPool(max_running_requests, max_context_len, device)
        self.attn_backend = create_attention_backend(
            attention_backend,
            self.kv_pool,
            self.req_to_token,
            cfg.head_dim**-0.5,
            device,
            kernels,
            num_heads=cfg.num_heads,
        )

    def _load(
        self,
        model_dir: str,
        kernels: ModuleType | None,
        gguf_file: str | None,
        gguf_native: bool,
        gguf_int8: bool,
        dummy_weights: bool,
        tensor_parallel: TensorParallel | None,
        quantize: str | None,
    ) -> torch.nn.Module:
        """The model as `__init__`'s arguments say, on this worker's device, its matmuls
        routed through `kernels` where given."""
        dtype, device = self.dtype, self.device
        self.integer_path = False
        if dummy_weights:
            model = dummy_model(self.config, dtype, device)
        elif gguf_file is None:
            model = load_model(model_dir, self.config, dtype, device)
        else:
            model = build_model(self.config, dtype, "cpu")
            native = gguf_native and dtype in (torch.float32, torch.bfloat16)
            # the blocks' matmuls quantize their inputs to 8 bits (a drafter's follow)
            self.integer_path = native and gguf_int8 and kernels is not None
            if native and kernels is None:
                logger.info("GGUF weights served dequantized (no CPU kernels on %s)", device)
            # with tensor_parallel, cut as it loads: each rank reads only its blocks
            served = load_gguf_model(
                gguf_file,
                model,
                self.config,
                kernels if native else None,
                gguf_int8,
                requantize=quantize,
                tp=tensor_parallel,
            )
            logger.info("GGUF blocks served as they are for %d weight matrices", served)
            model.to(device)
        if tensor_parallel is not None and gguf_file is None:  # this rank's share
            shard_llama(model, llama_shares(self.config, tensor_parallel))
        if quantize is not None and kernels is not None:
            for layer in model.layers:  # dense layers quantized (GGUF blocks stay)
                route_to_cpu_kernels(layer, kernels, quantize)
        model.set_cpu_kernels(kernels)  # packs only what has no GGUF blocks
        return model

    def to_forward_batch(self, wb: WorkerBatch) -> ForwardBatch:
        """Record the batch's slots in the req-to-token table and build the tensors, with one
        copy of what the host holds (nothing waits for the device)."""
        width = self.req_to_token.max_context_len
        prefix_places: list[int] = []
        prefix_slots: list[int] = []
        for row, start, slots in wb.table_writes:
            self.req_to_token.check_fits(start + len(slots))
            prefix_places.extend(range(row * width + start, row * width + start + len(slots)))
            prefix_slots.extend(slots)
        new_places: list[int] = []
        for row, prefix, ext in zip(wb.req_pool_indices, wb.prefix_lens, wb.extend_lens):
            self.req_to_token.check_fits(prefix + ext)
            new_places.extend(range(row * width + prefix, row * width + prefix + ext))
        fields = {
            "input_ids": wb.input_ids,
            "positions": wb.positions,
            "out_cache_loc": wb.out_cache_loc,
            "req_pool_indices": wb.req_pool_indices,
        }
        writes = {"prefix_places": prefix_places, "prefix_slots": prefix_slots}
        writes["new_places"] = new_places
        table = self.req_to_token
        # on a CPU the table is written from the host's lists (nothing staged for it)
        staged = stage(fields if table.on_cpu else {**fields, **writes}, self.device)
        written = {**writes, "out_cache_loc": wb.out_cache_loc} if table.on_cpu else staged
        if prefix_places:
            table.write_places(written["prefix_places"], written["prefix_slots"])
        table.write_places(written["new_places"], written["out_cache_loc"])
        custom = None
        if wb.custom_mask is not None:
            custom = to_device(torch.tensor(wb.custom_mask, dtype=torch.bool), self.device)
        return ForwardBatch(
            mode=wb.mode,
            input_ids=staged["input_ids"],
            positions=staged["positions"],
            out_cache_loc=staged["out_cache_loc"],
            req_pool_indices=staged["req_pool_indices"],
            prefix_lens=list(wb.prefix_lens),
            extend_lens=list(wb.extend_lens),
            custom_mask=custom,
            logits_rows="all" if wb.mode == ForwardMode.TARGET_VERIFY else "last",
            rows_host=list(wb.req_pool_indices),
        )

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states of every new token, plus captured layer inputs."""
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch, self.attn_backend)

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits for the rows `batch.logits_rows` selects."""
        return self.forward_batch(batch)[2]

    @torch.inference_mode()
    def forward_batch(
        self, batch: ForwardBatch
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Final hidden states of every new token, the captured layer inputs, and float32
        logits of the rows `batch.logits_rows` selects: through the graph runner where it
        holds the batch (its logits valid until its next replay), else eagerly."""
        bucket = self.graphs.bucket_for(batch) if self.graphs is not None else None
        if bucket is not None:
            return self.graphs.run(batch, bucket)
        hidden, captured = self.forward_hidden(batch)
        rows = hidden
        if batch.logits_rows == "last" and batch.num_tokens != batch.batch_size:
            ends = torch.tensor(batch.extend_lens).cumsum(0) - 1
            rows = hidden[ends.to(hidden.device)]
        return hidden, captured, self.model.compute_logits(rows)

    @torch.inference_mode()
    def forward(self, wb: WorkerBatch) -> WorkerResult:
        """Run one EXTEND or DECODE step and sample one token per request (and, where asked,
        score the input tokens of an EXTEND)."""
        return self.run(wb)[0]

    @torch.inference_mode()
    def run(
        self, wb: WorkerBatch, capture_layers: tuple[int, ...] = ()
    ) -> tuple[WorkerResult, ForwardBatch, torch.Tensor, list[torch.Tensor]]:
        """`forward`, also returning the batch, the final hidden states of every new token and
        the inputs of `capture_layers` (what a draft head is trained on)."""
        batch = self.to_forward_batch(wb)
        batch.capture_layers = capture_layers
        hidden, captured, logits = self.forward_batch(batch)
        out = sample(logits, wb.sampling, wb.vocab_mask, self.model.kernels)
        input_logprobs = self._input_logprobs(wb, batch, hidden) if wb.input_logprob_starts else []
        result = WorkerResult(
            out.next_token_ids.tolist(), out.logprobs, out.top_logprobs, input_logprobs
        )
        return result, batch, hidden, captured

    def use_graphs(
        self,
        batch_sizes: list[int],
        max_tree_tokens: int = 1,
        verify_max_batch_size: int | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        """Run decode steps of up to max(batch_sizes) requests (and, with `max_tree_tokens` >
        1, verification of trees up to that size) through the graph runner's static buffers,
        captured as CUDA graphs where the model runs on a GPU whose attention backend allows
        it; elsewhere they run eagerly through the same buffers."""
        buckets = plan_buckets(sorted(set(batch_sizes)), max_tree_tokens, verify_max_batch_size)
        on_gpu = self.device.startswith("cuda")
        if on_gpu:  # only what the backend can capture: the rest is faster without padding
            modes = self.attn_backend.capturable_modes
            buckets = [b for b in buckets if b.mode in modes]
            if not buckets:
                logger.warning(
                    "CUDA graphs: the %s attention backend cannot be captured; forwards run "
                    "eagerly",
                    type(self.attn_backend).__name__,
                )
                return
        self.graphs = GraphRunner(
            self.model, self.attn_backend, self.req_to_token, buckets, capture_layers
        )
        if on_gpu:
            self.graphs.capture()

    def grammar_ready(self, kind: str, text: str) -> bool:
        return True  # plain steps: the scheduler's own matchers mask them

    def kv_pool_info(self) -> dict:
        return {"bytes": self.kv_pool.nbytes, "committed": self.kv_pool.committed}

    def graph_info(self) -> dict | None:
        """The graph runner's summary for /get_server_info (None: no runner)."""
        return self.graphs.summary() if self.graphs is not None else None

    def _input_logprobs(
        self, wb: WorkerBatch, batch: ForwardBatch, hidden: torch.Tensor
    ) -> list[list[float]]:
        input_logprobs: list[list[float]] = []
        offset = 0
        for i, (start, ext) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
            first = wb.input_logprob_starts[i]
            scores: list[float] = []
            if first >= 0:
                targets = wb.input_ids[offset + first - start + 1 : offset + ext]
                if wb.input_logprob_next[i] >= 0:
                    targets = targets + [wb.input_logprob_next[i]]
                rows = hidden[offset + first - start : offset + first - start + len(targets)]
                logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
                chosen = torch.tensor(targets, device=logprobs.device)[:, None]
                scores = logprobs.gather(1, chosen)[:, 0].tolist()
            input_logprobs.append(scores)
            offset += ext
        return input_logprobs
