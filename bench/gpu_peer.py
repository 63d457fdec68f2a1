"""bench/gpu.py's peer: HF transformers on the same config and prompts, with a static cache under
torch.compile, timed end to end."""

from __future__ import annotations

import time

import torch

from bench.gpu_run import Bench
from bench.gpu_timing import random_prompts

GENERATE_COMPILES = "generate's own: torch.compile(mode='reduce-overhead') of its decode steps"


def part_peer(b: Bench, role: str) -> dict:
    """HF transformers on the `role` shape's config: random weights made on the device,
    `generate(cache_implementation="static")` compiled (mode reduce-overhead), greedy, the
    same prompts and lengths; each batch size's first call compiles (reported, not timed)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    a = b.args
    config = AutoConfig.from_pretrained(b.model_dir(role))
    dtype = getattr(torch, a.dtype)
    with torch.device(a.device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers before 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.to(dtype).eval()
    if a.device != "cuda":
        compiled = "none: transformers compiles generate's steps on a GPU only"
    elif hasattr(transformers, "CompileConfig"):
        # generate compiles its own decode steps with a static cache (compiling model.forward
        # as well would nest the two)
        compiled = GENERATE_COMPILES
    else:
        compiled = compile_forward(model)
    row = {"shape": a.shapes[role], "compile": compiled, "batches": {}}
    try:
        for batch in a.peer_batches:
            ids = torch.tensor(random_prompts(config.vocab_size, batch, a.prompt_len))
            ids = ids.to(a.device)
            first = peer_seconds(model, ids, a.new_tokens)
            if row["compile"] == GENERATE_COMPILES and not hasattr(model, "_compiled_call"):
                row["compile"] = compile_forward(model)  # it did not after all
                first += peer_seconds(model, ids, a.new_tokens)
            seconds = min(peer_seconds(model, ids, a.new_tokens) for _ in range(a.repeats))
            row["batches"][str(batch)] = {
                "e2e_tok_s": round(batch * a.new_tokens / seconds, 1),
                "e2e_s": round(seconds, 4),
                "first_call_s": round(first, 2),  # compilation and warm-up
            }
            b.report.figures[f"peer_{role}"] = row  # each batch size as it comes
            b.report.write()
    finally:
        torch._dynamo.reset()  # its graphs and their memory pools
    return row


def compile_forward(model: torch.nn.Module) -> str:
    model.forward = torch.compile(model.forward, mode="reduce-overhead")
    return "model.forward = torch.compile(model.forward, mode='reduce-overhead')"


def peer_seconds(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> float:
    """Seconds of transformers' greedy `generate` of exactly `new_tokens` after `ids`."""
    start = time.perf_counter()
    out = model.generate(  # which runs under no_grad
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # EOS masked, as spectral's ignore_eos
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )
    if ids.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens")
    return seconds
