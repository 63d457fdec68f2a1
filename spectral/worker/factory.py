"""Build the worker `ServerArgs` describe: the target alone, or with a drafter."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from spectral.args import ServerArgs
from spectral.constrained import GrammarBackend
from spectral.core.model import ResolvedModel
from spectral.layers.parallel import TensorParallel
from spectral.models.resolved import load_tokenizer
from spectral.speculative.drafters.base import DrafterContext, file_stamp
from spectral.worker.grammar_follower import GrammarFollower
from spectral.worker.graph_runner import DEFAULT_BATCH_SIZES, default_max_batch_size
from spectral.worker.model_worker import ModelWorker
from spectral.worker.round_graphs import RoundGraphs
from spectral.worker.spec_worker import SpeculativeWorker


def create_worker(
    args: ServerArgs, model: ResolvedModel, tensor_parallel: TensorParallel | None = None
) -> ModelWorker | SpeculativeWorker:
    """The model worker for `args` and `model` (one rank of `tensor_parallel`, where given);
    with speculative decoding on, wrapped with its drafter."""
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    worker = target_worker(args, model, tensor_parallel)
    spec = args.spec
    graph_sizes = graph_batch_sizes(args, worker.device, tensor_parallel)
    if spec is None:
        if graph_sizes:
            worker.use_graphs(graph_sizes)
        return worker
    drafter = None
    if spec.has_drafter:
        context = DrafterContext(
            spec,
            args,
            model,
            worker,
            load_lm=functools.partial(load_draft_lm, args, worker),
            target_vocab=lambda: load_tokenizer(model.tokenizer_dir).get_vocab(),
        )
        drafter = spec.entry.build(context)
    spec_worker = SpeculativeWorker(
        worker,
        drafter,
        head_tree_size=spec.num_draft_tokens if drafter is not None else None,
        merge_given_trees=spec.hybrid_merge,
        report_node_choices=spec.uses_lookahead,
        grammars=GrammarFollower(lambda: grammar_backend(model, args.grammar_cache_mib * 2**20)),
    )
    if graph_sizes:
        worker.use_graphs(
            graph_sizes,
            max(spec.num_draft_tokens, spec.hybrid_ngram),
            spec.max_batch_size or None,
            drafter.capture_layers if drafter is not None else (),
        )
        if drafter is not None:  # the batch sizes speculation runs at, as verification's
            cap = spec.max_batch_size or max(graph_sizes)
            sizes = [bs for bs in graph_sizes if bs <= cap] or [min(graph_sizes)]
            spec_worker.draft_graphs = drafter.use_graphs(sizes)
            if spec_worker.draft_graphs is not None:
                spec_worker.round_graphs = RoundGraphs(sizes, worker.device)
    if not spec.fixed_tree:
        from spectral.worker.cost_measure import load_or_measure

        parts = cost_key(args, model, spec_worker)
        if tensor_parallel is not None:
            parts["tp_size"] = tensor_parallel.world
        spec_worker.cost_model = load_or_measure(
            spec_worker, parts, spec.cost_model_path, tensor_parallel, spec.entry.catches_up
        )
    return spec_worker


def target_worker(
    args: ServerArgs, model: ResolvedModel, tensor_parallel: TensorParallel | None
) -> ModelWorker:
    """The target model's worker as `args` load it (refusing what does not go together)."""
    gguf_file = model.gguf_file
    if args.quantization in ("gguf", "gguf-int8") and gguf_file is None:
        raise ValueError(
            f"--quantization {args.quantization} needs a GGUF model ({args.model_path} is not one)"
        )
    if args.load_format == "dummy" and gguf_file is not None:
        raise ValueError(
            f"--load-format dummy takes a HF model directory ({args.model_path} is a GGUF)"
        )
    quantization = args.resolved_quantization(gguf_file is not None)
    return ModelWorker(
        model.model_dir,
        gguf_file=gguf_file,
        gguf_native=quantization != "none",
        gguf_int8=quantization == "gguf-int8",
        dummy_weights=args.load_format == "dummy",
        dtype=args.resolved_dtype(gguf_file is not None),
        device=args.resolved_device(),
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        max_context_len=model.context_len,
        attention_backend=args.attention_backend,
        use_cpu_kernels=not args.disable_cpu_kernels,
        tensor_parallel=tensor_parallel,
    )


def cost_key(args: ServerArgs, model: ResolvedModel, worker: SpeculativeWorker) -> dict:
    """Everything that changes what a round costs here: the cost model cached under it is
    measured anew when any part changes."""
    from spectral.kernels.cpu_kernels import build_dir_of, cpu_signature

    spec, target, drafter = args.spec, worker.target, worker.drafter
    device = target.device
    return {
        "machine": cpu_signature(),
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": str(Path(model.model_dir).resolve()),
        "gguf": file_stamp(model.gguf_file),
        "quantization": args.resolved_quantization(model.gguf_file is not None),
        "dtype": str(target.dtype),
        "device": device,
        # the kernels' build (their sources, this CPU): a faster kernel is measured anew
        "cpu_kernels": None if args.disable_cpu_kernels else build_dir_of("native").name,
        "attention": args.attention_backend,
        # the buckets (not the capture's timings): padded forwards cost what the bucket does
        "graphs": _graph_key(target.graph_info()),
        "algorithm": spec.algorithm,
        "head": drafter.cost_key if drafter is not None else None,
        "tree": [spec.num_steps, spec.topk],
        "draft_quantization": spec.draft_quantization,
        "token_map": file_stamp(spec.token_map),
    }


def graph_batch_sizes(
    args: ServerArgs, device: str, tensor_parallel: TensorParallel | None
) -> list[int] | None:
    """The decode batch sizes the graph runner holds, or None (no runner). On a GPU unless
    --disable-cuda-graph: --cuda-graph-bs, else the default sizes up to --cuda-graph-max-bs.
    On a CPU only --cuda-graph-bs, run eagerly through the static buffers (a test of the GPU's
    path). Not under tensor parallelism yet."""
    if args.disable_cuda_graph or tensor_parallel is not None:
        return None
    if args.cuda_graph_bs:
        return sorted(set(args.cuda_graph_bs))
    if not device.startswith("cuda"):
        return None
    cap = args.cuda_graph_max_bs or default_max_batch_size(device, args.max_running_requests)
    return [bs for bs in DEFAULT_BATCH_SIZES if bs <= cap] or [1]


def load_draft_lm(
    args: ServerArgs,
    target: ModelWorker,
    path: str,
    num_kv_slots: int,
    max_requests: int,
    max_context_len: int,
    quantize: str | None,
) -> tuple[ModelWorker, dict[str, int]]:
    """A drafter's own LM at `path` (a GGUF file or HF directory) loaded as the target is
    (dtype, device, --quantization, attention backend, CPU kernels), its matmul weights stored
    in more bits quantized to `quantize` where given; and its tokenizer's vocabulary."""
    from spectral.models.resolved import resolve_model

    draft, tokenizer = resolve_model(
        dataclasses.replace(args, model_path=path, tokenizer_path=None, context_length=None)
    )
    quantization = args.resolved_quantization(draft.gguf_file is not None)
    worker = ModelWorker(
        draft.model_dir,
        gguf_file=draft.gguf_file,
        gguf_native=quantization != "none",
        gguf_int8=quantization == "gguf-int8",
        dtype=target.dtype,
        device=target.device,
        max_total_tokens=num_kv_slots,
        max_running_requests=max_requests,
        max_context_len=max_context_len,
        attention_backend=args.attention_backend,
        use_cpu_kernels=not args.disable_cpu_kernels,
        quantize=quantize,
    )
    return worker, tokenizer.get_vocab()


def grammar_backend(model: ResolvedModel, cache_bytes: int) -> GrammarBackend:
    """The worker's grammar compiler (made for its first request under a grammar): the
    model's vocabulary and stop tokens, and the cache's bound, as the scheduler's."""
    return GrammarBackend(
        load_tokenizer(model.tokenizer_dir), model.vocab_size, model.stop_token_ids, cache_bytes
    )


def _graph_key(info: dict | None) -> list | None:
    if info is None:
        return None
    return [info["captured"], info["decode_batch_sizes"], info["verify_tree_sizes"]]
