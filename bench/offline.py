"""Offline decode speed: spectral vs transformers `generate`, same model, dtype and prompts.

Prints batch-1 greedy tokens/s of both and their ratio, then aggregate tokens/s at larger
batches: spectral (continuous batching) against transformers static batching (left-padded
`generate` over the same prompts). Results also go to bench/out/offline.json.

    python bench/offline.py --dtype bfloat16 --num-prompts 8 --max-new-tokens 128 --batches 16,64
    python bench/offline.py --dtype float32 --baseline-quantization none --skip-transformers
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import chat, mtbench_first_turns  # noqa: E402
from models import model_file  # noqa: E402
from spectral import Engine  # noqa: E402
from spectral.models.resolve import resolve_model_path  # noqa: E402

Prompt = str | list[int]  # text, or token ids


def inputs(prompts: Prompt | list[Prompt]) -> dict:
    """Engine.generate's argument for text or token ids, one prompt or a batch."""
    first = prompts[0] if isinstance(prompts, list) else prompts
    return {"input_ids": prompts} if isinstance(first, (int, list)) else {"prompt": prompts}


def spectral_batch1(
    engine: Engine, prompts: list[Prompt], new_tokens: int
) -> tuple[float, list[list[int]]]:
    """(tokens/s, outputs) of the prompts one after another, after a short warm-up."""
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.generate(**inputs(prompts[0]), sampling_params={**params, "max_new_tokens": 8})
    outputs, tokens, start = [], 0, time.perf_counter()
    for p in prompts:
        out = engine.generate(**inputs(p), sampling_params=params)
        outputs.append(out["output_ids"])
        tokens += len(out["output_ids"])
    return tokens / (time.perf_counter() - start), outputs


def spectral_batched(engine: Engine, prompts: list[Prompt], new_tokens: int) -> float:
    """Aggregate tokens/s of the prompts submitted at once, from an empty prefix cache."""
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(**inputs(prompts), sampling_params=params)
    return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - start)


def load_transformers(model_dir: str, dtype: torch.dtype):
    """The transformers model (loaded once per run) and a greedy, fixed-length generate config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = (model_dir, dtype)
    if key not in _TRANSFORMERS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        _TRANSFORMERS[key] = (AutoTokenizer.from_pretrained(model_dir), model)
    return _TRANSFORMERS[key]


_TRANSFORMERS: dict = {}


def greedy_kwargs(tok, new_tokens: int) -> dict:
    return dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tok.eos_token_id,
    )


def transformers_batched(model_dir: str, dtype: torch.dtype, prompts: list[str], new_tokens: int):
    tok, model = load_transformers(model_dir, dtype)
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    kwargs = greedy_kwargs(tok, new_tokens)
    with torch.inference_mode():
        start = time.perf_counter()
        gen = model.generate(**batch, **kwargs)
        elapsed = time.perf_counter() - start
    return (gen.shape[1] - batch["input_ids"].shape[1]) * len(prompts) / elapsed


def transformers_batch1(model_dir: str, dtype: torch.dtype, prompts: list[str], new_tokens: int):
    tok, model = load_transformers(model_dir, dtype)
    encoded = [tok(p, return_tensors="pt")["input_ids"] for p in prompts]
    kwargs = greedy_kwargs(tok, new_tokens)
    with torch.inference_mode():
        model.generate(encoded[0], **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        outputs, tokens, start = [], 0, time.perf_counter()
        for ids in encoded:
            gen = model.generate(ids, **kwargs)[0, ids.shape[1] :]
            outputs.append(gen.tolist())
            tokens += gen.numel()
    return tokens / (time.perf_counter() - start), outputs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--model", default=None, help="a kit model (bench/models.py); overrides it")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="16,64", help="comma-separated batch sizes")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--quantization",
        default="auto",
        help="spectral's --quantization (auto: a GGUF on a CPU through the integer path)",
    )
    ap.add_argument(
        "--baseline-quantization",
        default=None,
        help="also measure spectral at batch 1 with this --quantization (e.g. none), same run",
    )
    args = ap.parse_args()
    if args.model is not None:
        args.model_path = str(model_file(args.model))
    torch.set_num_threads(torch.get_num_threads())

    def make_engine(quantization: str) -> Engine:
        return Engine(
            model_path=args.model_path,
            dtype=args.dtype,
            max_total_tokens=32768,
            quantization=quantization,
        )

    if args.baseline_quantization:
        base = make_engine(args.baseline_quantization)
        base_prompts = [chat(base.tokenizer, q) for q in mtbench_first_turns(args.num_prompts)]
        b1, b_out = spectral_batch1(base, base_prompts, args.max_new_tokens)
        base.shutdown()
        print(f"spectral ({args.baseline_quantization:>4}) batch 1 : {b1:7.2f} tok/s")
    engine = make_engine(args.quantization)
    prompts = [chat(engine.tokenizer, q) for q in mtbench_first_turns(args.num_prompts)]
    results: dict[str, object] = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
    }
    s1, s_out = spectral_batch1(engine, prompts, args.max_new_tokens)
    results["spectral_batch1_tok_s"] = round(s1, 2)
    print(f"spectral      batch 1 : {s1:7.2f} tok/s")
    if args.baseline_quantization:
        same = sum(a == b for a, b in zip(s_out, b_out))
        results.update(
            {
                f"spectral_{args.baseline_quantization}_batch1_tok_s": round(b1, 2),
                "ratio_to_baseline_quantization": round(s1 / b1, 2),
            }
        )
        print(
            f"ratio {args.quantization}/{args.baseline_quantization} at batch 1: {s1 / b1:.2f}x "
            f"({same}/{len(prompts)} outputs identical)"
        )
    if not args.skip_transformers:
        t1, t_out = transformers_batch1(
            resolve_model_path(args.model_path),
            getattr(torch, args.dtype),
            prompts,
            args.max_new_tokens,
        )
        same = sum(a == b for a, b in zip(s_out, t_out))
        results.update(
            transformers_batch1_tok_s=round(t1, 2),
            ratio_batch1=round(s1 / t1, 2),
            identical_outputs=f"{same}/{len(prompts)}",
        )
        print(f"transformers  batch 1 : {t1:7.2f} tok/s")
        print(
            f"ratio spectral/transformers at batch 1: {s1 / t1:.2f}x "
            f"({same}/{len(prompts)} outputs identical)"
        )
    questions = mtbench_first_turns()
    for size in [int(b) for b in args.batches.split(",") if b]:
        batch_prompts = [chat(engine.tokenizer, q) for q in (questions * 2)[:size]]
        sb = spectral_batched(engine, batch_prompts, args.max_new_tokens)
        results[f"spectral_batch{size}_tok_s"] = round(sb, 2)
        print(f"spectral      batch {size:3d}: {sb:7.2f} tok/s aggregate")
        if not args.skip_transformers:
            tb = transformers_batched(
                resolve_model_path(args.model_path),
                getattr(torch, args.dtype),
                batch_prompts,
                args.max_new_tokens,
            )
            results[f"transformers_batch{size}_tok_s"] = round(tb, 2)
            results[f"ratio_batch{size}"] = round(sb / tb, 2)
            print(f"transformers  batch {size:3d}: {tb:7.2f} tok/s aggregate (static batching)")
            print(f"ratio spectral/transformers at batch {size}: {sb / tb:.2f}x")
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "offline.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
