"""Build the worker `ServerArgs` describe: the target alone, or with a drafter."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from spectral.args import ServerArgs
from spectral.constrained import GrammarBackend, GrammarFollower
from spectral.core.model import ResolvedModel
from spectral.layers.parallel import TensorParallel
from spectral.models.resolved import load_tokenizer
from spectral.speculative.settings import SpecSettings
from spectral.worker.graph_runner import DEFAULT_BATCH_SIZES, default_max_batch_size
from spectral.worker.model_worker import ModelWorker
from spectral.worker.spec_worker import SpeculativeWorker

DEFAULT_HEAD_DIR = Path(__file__).resolve().parent.parent / "assets" / "eagle3-smollm2-135m"


def resolve_draft_path(path: str) -> str:
    """A head directory; 'default' is the head shipped for the default model."""
    if path == "default":
        if not (DEFAULT_HEAD_DIR / "config.json").exists():
            raise FileNotFoundError(
                "no default draft head is installed with this build; pass a head directory"
            )
        return str(DEFAULT_HEAD_DIR)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"draft head directory {path!r} does not exist")
    return path


def create_worker(
    args: ServerArgs, model: ResolvedModel, tensor_parallel: TensorParallel | None = None
) -> ModelWorker | SpeculativeWorker:
    """The model worker for `args` and `model` (one rank of `tensor_parallel`, where given);
    with speculative decoding on, wrapped with its drafter."""
    dtype, device = args.resolved_dtype(), args.resolved_device()
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    gguf_file = model.gguf_file
    if args.quantization in ("gguf", "gguf-int8") and gguf_file is None:
        raise ValueError(
            f"--quantization {args.quantization} needs a GGUF model ({args.model_path} is not one)"
        )
    if args.load_format == "dummy" and gguf_file is not None:
        raise ValueError(
            f"--load-format dummy takes a HF model directory ({args.model_path} is a GGUF)"
        )
    worker = ModelWorker(
        model.model_dir,
        gguf_file=gguf_file,
        gguf_native=args.quantization != "none",
        gguf_int8=args.quantization == "gguf-int8",
        dummy_weights=args.load_format == "dummy",
        dtype=dtype,
        device=device,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        max_context_len=model.context_len,
        attention_backend=args.attention_backend,
        use_cpu_kernels=not args.disable_cpu_kernels,
        tensor_parallel=tensor_parallel,
    )
    spec = args.spec_settings()
    graph_sizes = graph_batch_sizes(args, device, tensor_parallel)
    if spec is None:
        if graph_sizes:
            worker.use_graphs(graph_sizes)
        return worker
    drafter = None
    if spec.algorithm == "STANDALONE":
        drafter = draft_model_drafter(args, model, worker, spec)
    elif spec.algorithm == "MEDUSA":
        from spectral.speculative.medusa import MedusaDrafter, load_medusa_heads

        heads = load_medusa_heads(
            spec.draft_model_path,
            worker.config.hidden_size,
            worker.config.vocab_size,
            dtype,
            device,
        )
        heads.set_cpu_kernels(worker.model.kernels, spec.draft_quantization)
        drafter = MedusaDrafter(
            heads, worker.req_to_token.max_requests, spec.topk, spec.num_steps, dtype, device
        )
    elif spec.uses_draft_head:
        from spectral.speculative.eagle_drafter import EagleDrafter
        from spectral.speculative.eagle_head import load_draft_head

        cfg = worker.config
        head = load_draft_head(
            resolve_draft_path(spec.draft_model_path),
            kind=spec.algorithm.lower(),
            target_hidden_size=cfg.hidden_size,
            target_vocab_size=cfg.vocab_size,
            target_num_layers=cfg.num_layers,
            max_positions=model.context_len + spec.num_steps + 1,
            dtype=dtype,
            device=device,
        )
        head.set_target(worker.model.embed, worker.model.compute_logits)
        head.set_cpu_kernels(worker.model.kernels, spec.draft_quantization)
        drafter = EagleDrafter(
            head,
            worker.num_kv_slots,
            worker.req_to_token,
            spec.topk,
            spec.num_steps,
            dtype,
            device,
            attention_backend=args.attention_backend,
        )
    spec_worker = SpeculativeWorker(
        worker,
        drafter,
        head_tree_size=spec.num_draft_tokens if drafter is not None else None,
        merge_given_trees=spec.hybrid_merge,
        report_node_choices=spec.uses_lookahead,
        grammars=GrammarFollower(lambda: grammar_backend(model)),
    )
    if graph_sizes:
        worker.use_graphs(
            graph_sizes,
            max(spec.num_draft_tokens, spec.hybrid_ngram),
            spec.max_batch_size or None,
            drafter.capture_layers if drafter is not None else (),
        )
    if not spec.fixed_tree:
        from spectral.kernels.cpu_kernels import build_dir_of, cpu_signature
        from spectral.worker.cost_measure import load_or_measure

        parts = {
            "machine": cpu_signature(),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "model": str(Path(model.model_dir).resolve()),
            "gguf": _file_stamp(gguf_file),
            "quantization": args.quantization,
            "dtype": str(dtype),
            "device": device,
            # the kernels' build (their sources, this CPU): a faster kernel is measured anew
            "cpu_kernels": None if args.disable_cpu_kernels else build_dir_of("native").name,
            "attention": args.attention_backend,
            # the buckets (not the capture's timings): padded forwards cost what the bucket does
            "graphs": _graph_key(worker.graph_info()),
            "algorithm": spec.algorithm,
            "head": _file_stamp(
                resolve_draft_path(spec.draft_model_path)
                if spec.is_eagle
                else spec.draft_model_path
            )
            if spec.uses_draft_head
            else None,
            "tree": [spec.num_steps, spec.topk],
            "draft_quantization": spec.draft_quantization,
            "token_map": _file_stamp(spec.token_map),
        }
        if tensor_parallel is not None:
            parts["tp_size"] = tensor_parallel.world
        spec_worker.cost_model = load_or_measure(
            spec_worker, parts, spec.cost_model_path, tensor_parallel
        )
    return spec_worker


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


def draft_model_drafter(
    args: ServerArgs, model: ResolvedModel, target: ModelWorker, spec: SpecSettings
):
    """STANDALONE: the draft LM at --speculative-draft-model-path loaded as the target is (same
    dtype, device and --quantization; its layers quantized again by
    --speculative-draft-quantization where given), its KV pool indexed by the target's slots
    plus scratch for the tree levels, drafting from --speculative-token-map's ids where given.
    A draft whose tokenizer differs from the target's is refused, naming both (their model
    vocabularies may be padded to different sizes)."""
    from spectral.models.resolved import resolve_model
    from spectral.speculative.draft_model import DraftModelDrafter, scratch_sizes

    topk, num_steps = spec.topk, spec.num_steps

    path = args.speculative_draft_model_path
    draft, draft_tokenizer = resolve_model(
        dataclasses.replace(args, model_path=path, tokenizer_path=None, context_length=None)
    )
    target_vocab = load_tokenizer(model.tokenizer_dir).get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=str)[:3]
        raise ValueError(
            f"the draft model {path} has another tokenizer than the target {args.model_path} "
            f"({len(draft_vocab)} against {len(target_vocab)} tokens; e.g. {differ}): a draft "
            "model must share the target's tokenizer"
        )
    rows, slots = scratch_sizes(topk, num_steps)
    worker = ModelWorker(
        draft.model_dir,
        gguf_file=draft.gguf_file,
        gguf_native=args.quantization != "none",
        gguf_int8=args.quantization == "gguf-int8",
        dtype=target.dtype,
        device=target.device,
        max_total_tokens=target.num_kv_slots + 1 + slots,
        max_running_requests=rows,
        max_context_len=model.context_len + num_steps + 1,
        attention_backend=args.attention_backend,
        use_cpu_kernels=not args.disable_cpu_kernels,
        quantize=spec.draft_quantization,
    )
    return DraftModelDrafter(
        worker,
        target.req_to_token,
        target.num_kv_slots,
        model.vocab_size,
        topk,
        num_steps,
        spec.token_map,
    )


def grammar_backend(model: ResolvedModel) -> GrammarBackend:
    """The worker's grammar compiler (made for its first request under a grammar): the
    model's vocabulary and stop tokens, as the scheduler's."""
    return GrammarBackend(
        load_tokenizer(model.tokenizer_dir), model.vocab_size, model.stop_token_ids
    )


def _graph_key(info: dict | None) -> list | None:
    if info is None:
        return None
    return [info["captured"], info["decode_batch_sizes"], info["verify_tree_sizes"]]


def _file_stamp(path: str | Path | None) -> list | None:
    """A file's (or a directory's files') path, size and modification time."""
    if path is None:
        return None
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
