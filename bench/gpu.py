"""Speed on a CUDA GPU against what the GPU allows, in one run (issue 53's figures), on models of
bench/shapes.py's shapes with random weights made on the device (--load-format dummy):

- bandwidth: the device's read bandwidth (a reduction, and a copy counting read and write);
- decode_<shape>: plain greedy decoding's steady tokens/s at each batch size, and at batch 1 the
  fraction of the bandwidth bound (bandwidth / the model's weight bytes) it reaches;
- verify_8b: a 64-token tree's verify forward against a decode step (the start-up cost curve);
- spec_<shape>: an EAGLE-3 round (random head, fixed tree) against a plain step;
- profile: kernel launches a decoded token (bench/gpu_profile.py);
- peer_1.5b: HF transformers, static cache and torch.compile, on the same config and prompts.

The JSON (device, commit, driver, versions, figures, and `checks` against the targets) goes to
--out and, on a GPU, bench/results/gpu-latest.json, rewritten after every part: a part that
fails or runs out of --budget-s leaves its figures null and says why.

    python bench/gpu.py                                  # bf16, every part (~3 min on an H100)
    python bench/gpu.py --parts bandwidth,decode_8b      # some parts
    python bench/gpu.py --device cpu --shapes tiny --dtype float32   # the logic, on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_profile import launches_per_token  # noqa: E402
from bench.shapes import SHAPES, make_model_dir  # noqa: E402
from spectral import Engine  # noqa: E402
from spectral.args import ServerArgs  # noqa: E402
from spectral.layers.linear import weight_bytes  # noqa: E402
from spectral.speculative.eagle_head import DraftHead, DraftHeadConfig  # noqa: E402
from spectral.worker.cost_measure import measure as measure_costs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gpu-latest.json"
ROLES = ("8b", "1.5b", "default")
# The planner's usual tree: 3 draft levels of top-4, 8 tokens verified a request.
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
VERIFY_TOKENS = 64
# (name, op, target, where the value is among the figures, the other part it needs)
CHECKS = (
    ("bs1_8b_bound_fraction", ">=", 0.70, ("decode_8b", "bound_fraction"), "bandwidth"),
    ("bs1_1.5b_bound_fraction", ">=", 0.45, ("decode_1.5b", "bound_fraction"), "bandwidth"),
    ("bs1_default_tok_s", ">=", 500, ("decode_default", "batches", "1", "tok_s"), None),
    ("spec_round_ratio_1.5b", "<=", 1.3, ("spec_1.5b", "round_ratio"), "decode_1.5b"),
    ("spec_round_ratio_8b", "<=", 1.3, ("spec_8b", "round_ratio"), "decode_8b"),
    ("verify64_ratio_8b", "<=", 1.15, ("verify_8b", "verify64_ratio"), None),
    ("peer_bs1_ratio_1.5b", ">=", 1.0, ("peer_1.5b", "ratio", "1"), "decode_1.5b"),
    ("peer_bs16_ratio_1.5b", ">=", 2.0, ("peer_1.5b", "ratio", "16"), "decode_1.5b"),
)


def random_prompts(vocab_size: int, count: int, length: int) -> list[list[int]]:
    """Prompts of `length` random token ids (past bench/shapes.py's special tokens)."""
    rng = random.Random(count)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def best_seconds(fn: Callable[[], object], device: str, repeats: int = 10) -> float:
    """The fastest of `repeats` calls of `fn` after two warm-ups (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return min(times)


class Bench:
    """One run: its options, model directories, figures and the report written after each part."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.start = time.perf_counter()
        self.figures: dict[str, dict] = {}
        self.parts: dict[str, dict] = {}
        self.notes: list[str] = []
        self.failed: list[dict] = []
        self.header = environment(args)

    def model_dir(self, role: str) -> str:
        shape = self.args.shapes[role]
        path = self.tmp / "models" / shape
        return str(path) if path.exists() else make_model_dir(path, shape)

    @contextlib.contextmanager
    def engine(self, role: str, batches: list[int], **options) -> Iterator[tuple[Engine, float]]:
        """An engine on the `role` shape for up to max(batches) requests, and its start-up
        seconds (CUDA graphs captured for `batches` where ServerArgs has the flags); shut down
        on leaving (run_parts frees its memory once the part returns)."""
        a = self.args
        fields = {f.name for f in dataclasses.fields(ServerArgs)}
        graphs = dict(
            disable_cuda_graph=False, cuda_graph_max_bs=max(batches), cuda_graph_bs=sorted(batches)
        )
        tokens = max(batches) * (a.prompt_len + a.new_tokens + 16) + 4096
        start = time.perf_counter()
        engine = Engine(
            model_path=self.model_dir(role),
            dtype=a.dtype,
            device=a.device,
            attention_backend=a.backend,
            load_format="dummy",
            disable_radix_cache=True,
            disable_cpu_kernels=a.device == "cpu",  # the CPU run checks logic, not speed
            max_running_requests=max(batches),
            max_total_tokens=tokens,
            **{k: v for k, v in graphs.items() if k in fields},
            **options,
        )
        try:
            yield engine, round(time.perf_counter() - start, 2)
        finally:
            engine.shutdown()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def report(self) -> dict:
        figures = derive(self.figures, self.args.tau)
        return {
            **self.header,
            "elapsed_s": round(self.elapsed(), 1),
            "parts": self.parts,
            "figures": figures,
            "checks": checks(figures, self.parts),
            "notes": self.notes,
            "failed": self.failed,
        }

    def write(self) -> None:
        text = json.dumps(self.report(), indent=1) + "\n"
        for path in self.args.write_to:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f".{path.name}.tmp")
            staging.write_text(text)
            os.replace(staging, path)  # a reader sees the old report or the new one


def first_line(command: list[str]) -> str | None:
    """The first line `command` prints, or None where it fails."""
    try:
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def environment(args: argparse.Namespace) -> dict:
    """What the run ran on: device, commit, driver and versions, and its settings."""
    commit, source = first_line(["git", "rev-parse", "HEAD"]), "git"
    if commit is None:
        commit, source = os.environ.get("GPU_CHECK_COMMIT") or None, "GPU_CHECK_COMMIT"
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    versions["cuda"] = torch.version.cuda
    for package in ("triton", "flashinfer-python", "transformers"):
        try:
            versions[package.split("-")[0]] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package.split("-")[0]] = None
    cuda = args.device == "cuda"
    settings = ("dtype", "backend", "shapes", "prompt_len", "new_tokens", "short_tokens")
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "commit": commit,
        "commit_source": source if commit else None,
        "driver": first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        if cuda
        else None,
        "versions": versions,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {k: getattr(args, k) for k in (*settings, "repeats", "budget_s")},
    }


# ---- timing through the engine ---------------------------------------------------------------


def graph_info(engine: Engine) -> dict:
    """What the engine reports of its CUDA graphs (buckets, capture seconds, memory)."""
    return {k: v for k, v in engine.get_server_info().items() if "graph" in k}


def steady_decode(engine: Engine, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Steady-state decoding of `prompts` at once, greedy, ignoring EOS: the best of
    --repeats generations of --new-tokens and of --short-tokens each; a step is the difference
    in time over the difference in decode steps (prefill and the first step cancel). A
    speculative engine's steps are its rounds."""

    def run(tokens: int) -> tuple[float, dict]:
        params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
        before = engine.get_server_info()["stats"]
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        after = engine.get_server_info()["stats"]
        short = [len(o["output_ids"]) for o in outs if len(o["output_ids"]) != tokens]
        if short:
            raise RuntimeError(f"requests ended early: {short} of {tokens} tokens (see the log)")
        return seconds, {k: after[k] - before[k] for k in after}

    run(args.short_tokens)  # warm-up: first-use kernels, graphs, JIT builds
    best: dict[int, tuple[float, dict]] = {}
    for _ in range(args.repeats):
        for tokens in (args.short_tokens, args.new_tokens):
            got = run(tokens)
            if tokens not in best or got[0] < best[tokens][0]:
                best[tokens] = got
    (t0, s0), (t1, s1) = best[args.short_tokens], best[args.new_tokens]
    steps = s1["decode_steps"] - s0["decode_steps"]
    step_s = (t1 - t0) / steps
    if step_s <= 0:
        raise RuntimeError(
            f"{args.new_tokens} tokens took no longer than {args.short_tokens} ({t1:.3f} s "
            f"against {t0:.3f} s): timing noise; raise --new-tokens or --repeats"
        )
    rounds = s1["spec_verify_ct"]
    return {
        "step_ms": round(1000 * step_s, 4),
        "tok_s": round(len(prompts) / step_s, 1),
        "e2e_tok_s": round(len(prompts) * args.new_tokens / t1, 1),  # prefill included
        "e2e_s": round(t1, 4),
        "decode_steps": s1["decode_steps"],
        "spec_rounds": rounds,
        "accept_length": round(s1["spec_emitted_tokens"] / rounds, 3) if rounds else None,
    }


# ---- the parts -------------------------------------------------------------------------------


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


def unread_embedding_bytes(model: torch.nn.Module) -> int:
    """Bytes of the input embedding table where the LM head does not share it: a step reads
    one row of it a request, not the table (0 for tied embeddings)."""
    params = dict(model.named_parameters())  # a shared tensor is listed once
    embed = params.get("embed_tokens.weight")
    return embed.nbytes if embed is not None and "lm_head.weight" in params else 0


def part_verify(b: Bench, role: str) -> dict:
    """The cost curve an NGRAM engine measures at start-up (no head: the target's forwards
    alone), measured --verify-curves times before it serves anyone; each point the fastest.
    The engine starts with a stand-in curve (no start-up measurement, nothing cached)."""
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
        "steady step of bench.gpu.steady_decode (draft + verify + host, every step a round) "
        f"against decode_{role}'s batch-1 step",
    }


def part_profile(b: Bench, role: str) -> dict:
    with b.engine(role, [1]) as (engine, _):
        prompt = random_prompts(engine.model.vocab_size, 1, b.args.prompt_len)[0]
        counts = launches_per_token(engine, prompt)
    return {"shape": b.args.shapes[role], "per_token": counts}


def part_peer(b: Bench, role: str) -> dict:
    """HF transformers on the same config: random weights made on the device,
    `generate(cache_implementation="static")` under torch.compile (mode reduce-overhead),
    greedy, the same prompts and lengths; the first call per batch size compiles (reported,
    not timed)."""
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
            b.figures[f"peer_{role}"] = row  # each batch size as it comes
            b.write()
    finally:
        torch._dynamo.reset()  # its graphs and their memory pools
    return row


GENERATE_COMPILES = "generate's own: torch.compile(mode='reduce-overhead') of its decode steps"


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


PARTS: dict[str, tuple[Callable[[Bench], dict], float]] = {
    # name: (what it measures, the least seconds it needs on an H100); in the order they run
    "bandwidth": (part_bandwidth, 3),
    "decode_8b": (lambda b: part_decode(b, "8b"), 10),
    "decode_1.5b": (lambda b: part_decode(b, "1.5b"), 10),
    "decode_default": (lambda b: part_decode(b, "default"), 5),
    "verify_8b": (lambda b: part_verify(b, "8b"), 10),
    "spec_1.5b": (lambda b: part_spec(b, "1.5b"), 10),
    "spec_8b": (lambda b: part_spec(b, "8b"), 15),
    "profile": (lambda b: part_profile(b, "default"), 5),
    "peer_1.5b": (lambda b: part_peer(b, "1.5b"), 60),
}


# ---- figures derived from the parts, and the checks ------------------------------------------


def derive(figures: dict, tau: float | None) -> dict:
    """The figures with the fractions and ratios that join two parts (null where one is
    missing)."""
    out = json.loads(json.dumps(figures))  # a copy
    bound_gb_s = (out.get("bandwidth") or {}).get("bound_gb_s")
    for role in ROLES:
        decode = out.get(f"decode_{role}")
        if not decode:
            continue
        one = decode["batches"].get("1")
        bound = bound_gb_s * 1e9 / decode["weight_bytes"] if bound_gb_s else None
        decode["bound_tok_s"] = round(bound, 1) if bound else None
        decode["bound_fraction"] = round(one["tok_s"] / bound, 4) if bound and one else None
        if bound and one:  # against the bytes a step reads (the stricter bound)
            read = decode["weight_bytes"] - decode["unread_embedding_bytes"]
            decode["read_bound_fraction"] = round(one["tok_s"] * read / (bound_gb_s * 1e9), 4)
        if one:
            decode["ratio_to_bs1"] = {
                n: round(row["tok_s"] / one["tok_s"], 3) for n, row in decode["batches"].items()
            }
    for role in ROLES:
        step = ((out.get(f"decode_{role}") or {}).get("batches") or {}).get("1")
        spec = out.get(f"spec_{role}")
        if spec:
            spec["plain_step_ms"] = step["step_ms"] if step else None
            spec["round_ratio"] = round(spec["round_ms"] / step["step_ms"], 4) if step else None
            if tau and step:
                spec["projected_speedup"] = round(tau / spec["round_ratio"], 3)
        verify = out.get(f"verify_{role}")
        if verify:
            ms = verify["verify_ms"].get(str(VERIFY_TOKENS))
            verify["verify64_ratio"] = round(ms / verify["decode_ms"], 4) if ms else None
        peer = out.get(f"peer_{role}")
        if peer:
            ours = (out.get(f"decode_{role}") or {}).get("batches") or {}
            peer["ratio"] = {
                n: round(ours[n]["e2e_tok_s"] / row["e2e_tok_s"], 3) if n in ours else None
                for n, row in peer["batches"].items()
            }
    if tau:
        out["projection"] = {
            "tau": tau,
            "label": "a projection: speculative speed-up = tau (accept length measured on the "
            "CPU for the shipped head) / the round ratio measured here",
        }
    return out


def lookup(figures: dict, path: tuple[str, ...]) -> float | None:
    value: object = figures
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, (int, float)) else None


def checks(figures: dict, parts: dict[str, dict]) -> list[dict]:
    """Each check's value against its target; a null value says why (its parts' status)."""
    out = []
    for name, op, target, path, other in CHECKS:
        value = lookup(figures, path)
        passed = None if value is None else value >= target if op == ">=" else value <= target
        check = {"name": name, "value": value, "op": op, "target": target, "passed": passed}
        if value is None:
            status = {p: parts.get(p, {}).get("status", "not asked for") for p in (path[0], other)}
            why = [f"{p} {s}" for p, s in status.items() if p and s != "ok"]
            check["why_null"] = ", ".join(why) or "not measured (see notes)"
        out.append(check)
    return out


# ---- the run ---------------------------------------------------------------------------------


def run_parts(b: Bench, names: list[str]) -> None:
    for name in names:
        b.parts[name] = {"status": "pending"}
    b.write()
    for name in names:
        fn, need = PARTS[name]
        left = b.args.budget_s - b.elapsed()
        if left < need:
            b.parts[name] = {"status": "skipped", "reason": f"{left:.0f} s of budget left"}
            b.notes.append(f"{name}: skipped, {left:.0f} s of --budget-s left (needs ~{need} s)")
            b.write()
            continue
        print(f"== {name} ({left:.0f} s of budget left)", flush=True)
        start = time.perf_counter()
        b.parts[name] = {"status": "running"}
        try:
            b.figures[name] = fn(b)
            b.parts[name] = {"status": "ok"}
        except KeyboardInterrupt:
            b.parts[name] = {"status": "interrupted"}
            b.failed.append({"part": name, "error": "interrupted (the run's time limit)"})
            for rest in names[names.index(name) + 1 :]:
                b.parts[rest] = {"status": "skipped", "reason": "interrupted"}
            b.write()
            raise
        except Exception as err:  # noqa: BLE001 - recorded; the other parts still run
            error = f"{type(err).__name__}: {err}"[:2000]
            print(f"{name} FAILED: {error}", flush=True)
            b.parts[name] = {"status": "failed"}
            b.failed.append({"part": name, "error": error})
        release()  # the part's engine or model, gone with its frame
        b.parts[name]["seconds"] = round(time.perf_counter() - start, 1)
        b.write()
        if name in b.figures:
            print(json.dumps(derive(b.figures, b.args.tau)[name])[:600], flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument(
        "--shapes",
        default="",
        help="bench/shapes.py shapes standing in for 8b, 1.5b and default: one name for all "
        "(tiny), or role=shape pairs (1.5b=tiny,8b=1.5b); default: each its own",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="auto", help="attention backend")
    ap.add_argument("--batches", default="1,16,64", help="decode_1.5b's batch sizes")
    ap.add_argument("--peer-batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--short-tokens", type=int, default=16, help="the run subtracted")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--verify-curves", type=int, default=3, help="verify_8b's measurements")
    ap.add_argument("--bandwidth-gib", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=330, help="no part starts after this")
    ap.add_argument("--tau", type=float, default=None, help="accept length for a projection")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gpu.json")
    ap.add_argument(
        "--results", type=Path, default=None, help=f"default on a GPU: {RESULTS.relative_to(ROOT)}"
    )
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    args.batches = sorted({1, *(int(n) for n in args.batches.split(",") if n)})
    args.peer_batches = [int(n) for n in args.peer_batches.split(",") if n]
    shapes = {role: role for role in ROLES}
    for item in [s for s in args.shapes.split(",") if s]:
        role, _, shape = item.rpartition("=")
        for r in [role] if role else ROLES:
            shapes[r] = shape
    bad = [s for s in shapes.values() if s not in SHAPES] + [r for r in shapes if r not in ROLES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; shapes are {', '.join(SHAPES)}, roles {ROLES}")
    args.shapes = shapes
    if not 0 < args.short_tokens < args.new_tokens:
        ap.error("need 0 < --short-tokens < --new-tokens")
    results = args.results or (RESULTS if args.device == "cuda" else None)
    args.write_to = [args.out] + ([results] if results else [])
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU; torch sees none (--device cpu runs the logic)")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout still writes
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        if args.device == "cpu":
            bench.notes.append("a CPU run: the logic only, its figures mean nothing")
        try:
            run_parts(bench, args.parts)
        except KeyboardInterrupt:
            print("interrupted; the report so far is written", flush=True)
        bench.write()
    for check in bench.report()["checks"]:
        value = "null" if check["value"] is None else f"{check['value']:.4g}"
        op, target, passed = check["op"], check["target"], check["passed"]
        print(f"{check['name']:26s} {value:>10s} {op} {target:<5} {passed}")
    print(f"wrote {', '.join(str(p) for p in args.write_to)}")
    if bench.failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
