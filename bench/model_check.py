"""spectral against transformers on a real GGUF: greedy continuations of the same prompts,
token for token (float32), the texts side by side.

    python bench/models.py qwen2.5-coder-0.5b
    python bench/model_check.py --model qwen2.5-coder-0.5b [--new-tokens 32] [--out f.json]

Each side runs in a process of its own (a 1.5B model dequantized to float32 takes ~7 GB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.data import chat  # noqa: E402
from bench.models import model_file  # noqa: E402

PROMPTS = [
    ("text", "The capital of France is"),
    ("chat", "Write a Python function that checks whether a number is prime."),
    ("chat", "What does the HTTP status code 404 mean?"),
]


def prompt_ids(tokenizer) -> list[list[int]]:
    texts = [chat(tokenizer, text) if kind == "chat" else text for kind, text in PROMPTS]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def run_spectral(gguf: Path, new_tokens: int, quantization: str) -> dict:
    from spectral import Engine

    start = time.perf_counter()
    engine = Engine(
        model_path=str(gguf), dtype="float32", quantization=quantization, max_total_tokens=4096
    )
    loaded = time.perf_counter() - start
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    outs = engine.generate(input_ids=prompt_ids(engine.tokenizer), sampling_params=params)
    result = {
        "architecture": engine.model.architecture,
        "features": engine.model.features,
        "load_s": round(loaded, 1),
        "ids": [o["output_ids"] for o in outs],
        "texts": [o["text"] for o in outs],
    }
    engine.shutdown()
    return result


def run_transformers(gguf: Path, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_generate_greedy import hf_greedy  # the tests' oracle (their conftest too)

    start = time.perf_counter()
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), dtype=torch.float32, **kwargs
    ).eval()
    loaded = time.perf_counter() - start
    # Plain greedy steps over transformers' KV cache, past EOS as spectral's ignore_eos
    # (generate's min_new_tokens would mask EOS instead, changing the argmax).
    ids = [hf_greedy(model, prompt, new_tokens) for prompt in prompt_ids(tokenizer)]
    texts = [tokenizer.decode(new, skip_special_tokens=True) for new in ids]
    return {
        "architecture": type(model).__name__,
        "load_s": round(loaded, 1),
        "ids": ids,
        "texts": texts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a kit model or a .gguf")
    parser.add_argument("--new-tokens", type=int, default=32)
    # the exact paths (auto would take the integer path on a CPU, not transformers' values)
    parser.add_argument("--quantization", default="gguf", choices=["gguf", "none"])
    parser.add_argument("--side", choices=["spectral", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gguf = model_file(args.model)
    if args.side:
        if args.side == "spectral":
            result = run_spectral(gguf, args.new_tokens, args.quantization)
        else:
            result = run_transformers(gguf, args.new_tokens)
        args.out.write_text(json.dumps(result))
        return

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("spectral", "transformers"):
            out = Path(tmp) / f"{side}.json"
            cmd = [sys.executable, __file__, "--model", str(gguf), "--side", side]
            cmd += ["--new-tokens", str(args.new_tokens), "--quantization", args.quantization]
            subprocess.run([*cmd, "--out", str(out)], check=True)
            results[side] = json.loads(out.read_text())
    ours, theirs = results["spectral"], results["transformers"]
    print(f"# {gguf.name}: {ours['architecture']}, {ours['features']}")
    print(f"# load: spectral {ours['load_s']} s, transformers {theirs['load_s']} s")
    same = 0
    for (_, prompt), a, b, ta, tb in zip(
        PROMPTS, ours["ids"], theirs["ids"], ours["texts"], theirs["texts"]
    ):
        equal = a == b
        same += equal
        print(f"\n## {prompt!r}: {'identical' if equal else 'DIFFERENT'} ({len(a)} tokens)")
        print(f"spectral:     {ta!r}")
        print(f"transformers: {tb!r}")
    print(f"\n{same}/{len(PROMPTS)} prompts token-identical")
    if args.out:
        args.out.write_text(json.dumps({"model": gguf.name, **results}, indent=1))


if __name__ == "__main__":
    main()
