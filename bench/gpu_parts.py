"""bench/gpu.py's measuring parts through spectral: read bandwidth, decode, a verify cost curve,
EAGLE-3 rounds (with the random head they need) and kernel launches a token. Each returns its
figures; bench/gpu_report.py joins them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.gpu_profile import launches_per_token
from bench.gpu_report import VERIFY_TOKENS
from bench.gpu_run import Bench
from bench.gpu_timing import best_seconds, graph_info, random_prompts, steady_decode
from spectral.layers.linear import weight_bytes
from spectral.speculative.drafters.eagle_head import DraftHead, DraftHeadConfig
from spectral.worker.cost_measure import measure as measure_costs

# The planner's usual tree: 3 draft levels of top-4, 8 tokens verified a request.
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)


def part_bandwidth(b: Bench) -> dict:
    device = b.args.device
    size = b.args.bandwidth_gib * 2**30 if device == "cuda" else 64 * 2**20
    x = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    read_gb_s = size / best_seconds(x.sum, device) / 1e9
    copy_gb_s = 2 * size / best_seconds(lambda: y.copy_(x), device) / 1e9
    return {
        "bytes": size,
        "read_gb_s": round(read_gb_s, 1),  # x.sum(): reads x once
        "copy_gb_s": round(copy_gb_s, 1),  # y.copy_(x): reads and writes, both counted
        "bound_gb_s": round(max(read_gb_s, copy_gb_s), 1),
        "method": "a bf16 tensor, the best of 10 after 2 warm-ups (CUDA events on a GPU); the "
        "bound is the higher of a reduction's read rate and a copy's read+write rate",
    }


def part_decode(b: Bench, role: str) -> dict:
    batches = b.args.batches if role == "1.5b" else [1]
    with b.engine(role, batches) as (engine, startup):
        row = {
            "shape": b.args.shapes[role],
            "weight_bytes": weight_bytes(engine.worker.model),
            "unread_embedding_bytes": unread_embedding_bytes(engine.worker.model),
            "startup_s": startup,
            "graphs": graph_info(engine),
            "batches": {},
        }
        for batch in batches:
            prompts = random_prompts(engine.model.vocab_size, batch, b.args.prompt_len)
            row["batches"][str(batch)] = steady_decode(engine, prompts, b.args)
    return row


def part_in_turn(b: Bench, role: str) -> dict:
    """decode_<role>'s batches with each step built only after the previous one's tokens are
    in (--disable-overlap-schedule): what launching steps ahead gives (derive_joins)."""
    batches = [n for n in b.args.batches if n <= 16]
    with b.engine(role, batches, disable_overlap_schedule=True) as (engine, startup):
        rows = {}
        for batch in batches:
            prompts = random_prompts(engine.model.vocab_size, batch, b.args.prompt_len)
            rows[str(batch)] = steady_decode(engine, prompts, b.args)
    return {"shape": b.args.shapes[role], "startup_s": startup, "batches": rows}


def unread_embedding_bytes(model: torch.nn.Module) -> int:
    """Bytes of the input embedding table where the LM head does not share it: a step reads
    one row of it a request, not the table (0 for tied embeddings)."""
    params = dict(model.named_parameters())  # a shared tensor is listed once
    embed = params.get("embed_tokens.weight")
    return embed.nbytes if embed is not None and "lm_head.weight" in params else 0


def part_verify(b: Bench, role: str) -> dict:
    """The cost curve an NGRAM engine measures at start-up (the target's forwards alone), the
    fastest of --verify-curves measurements. The engine starts on a stand-in curve, so it
    measures nothing itself."""
    stand_in = b.tmp / "stand-in-cost.json"
    stand_in.write_text(json.dumps({"verify": [[1, 1.0], [64, 1.0]], "decode_one": 1.0}))
    options = dict(speculative_num_draft_tokens=VERIFY_TOKENS, speculative_cost_model=str(stand_in))
    with b.engine(role, [1], speculative_algorithm="NGRAM", **options) as (engine, startup):
        curves = [measure_costs(engine.worker) for _ in range(b.args.verify_curves)]
        graphs = graph_info(engine)
    verify = {n: min(dict(c.verify)[n] for c in curves) for n, _ in curves[0].verify}
    return {
        "shape": b.args.shapes[role],
        "startup_s": startup,
        "decode_ms": round(min(c.decode_one for c in curves), 4),
        "verify_ms": {str(n): round(ms, 4) for n, ms in verify.items()},
        "graphs": graphs,
        "method": "spectral.worker.cost_measure: one request over a 256-token prefix, a chain "
        "tree of n tokens verified (TARGET_VERIFY) and a decode step, each the median of 3 "
        f"worker forwards; the fastest of {len(curves)} such curves",
    }


def make_eagle3_head(path: Path, model_dir: str, device: str, dtype: str) -> str:
    """A random EAGLE-3 head of the published heads' shape for the target at `model_dir`: one
    layer of the target's width and MLP, a 32000-token draft vocabulary (made on `device`)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    draft_vocab = min(32000, vocab // 2)
    cfg = DraftHeadConfig(
        kind="eagle3",
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_heads=heads,
        num_kv_heads=config["num_key_value_heads"],
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        rope_theta=config["rope_theta"],
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=hidden,
        fc_bias=False,
        # the target layers fused (inputs of): the published heads' choice, or a tiny
        # model's every layer
        aux_layers=(2, layers // 2, layers - 3) if layers > 5 else (0, layers // 2, layers),
    )
    torch.manual_seed(0)
    with torch.device(device):
        head = DraftHead(cfg, max_positions=64).to(getattr(torch, dtype))
        used = torch.randperm(vocab)[:draft_vocab].sort().values
        head.d2t.copy_(used - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[used] = True
    head.save(str(path))
    return str(path)


def part_spec(b: Bench, role: str) -> dict:
    a = b.args
    model_dir = b.model_dir(role)
    head = make_eagle3_head(b.tmp / f"head-{a.shapes[role]}", model_dir, a.device, a.dtype)
    options = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=head,
        speculative_fixed_tree=True,
        speculative_hybrid_ngram=0,  # the head drafts every round
        **TREE,
    )
    with b.engine(role, [1], **options) as (engine, startup):
        prompts = random_prompts(engine.model.vocab_size, 1, a.prompt_len)
        timing = steady_decode(engine, prompts, a)
        graphs = graph_info(engine)
    rounds = timing["spec_rounds"]
    return {
        "shape": a.shapes[role],
        "startup_s": startup,
        "tree": {k.removeprefix("speculative_"): v for k, v in TREE.items()},
        "round_ms": timing["step_ms"],
        "plain_steps_among_rounds": timing["decode_steps"] - rounds,
        "accept_length": timing["accept_length"],
        "timing": timing,
        "graphs": graphs,
        "method": "EAGLE3, a random head of the published shape, fixed tree, batch 1: the "
        "steady step of bench.gpu_timing.steady_decode (draft + verify + host, every step a "
        f"round) against decode_{role}'s batch-1 step",
    }


def part_profile(b: Bench, role: str) -> dict:
    with b.engine(role, [1]) as (engine, _):
        prompt = random_prompts(engine.model.vocab_size, 1, b.args.prompt_len)[0]
        counts = launches_per_token(engine, prompt)
    return {"shape": b.args.shapes[role], "per_token": counts}
