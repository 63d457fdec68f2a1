"""bench/gpu.py's report: what the run ran on, each part's status and figures, the figures that
join two parts, and issue 53's checks against their targets; rewritten whole after each part."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("8b", "1.5b", "default")
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


class Report:
    """What a run has found so far; `write` puts it whole at every --out/--results path."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.start = time.perf_counter()
        self.header = environment(args)
        self.tau: float | None = args.tau
        self.paths: list[Path] = args.write_to
        self.parts: dict[str, dict] = {}  # name: {"status": ..., "seconds": ...}
        self.figures: dict[str, dict] = {}
        self.notes: list[str] = []
        self.failed: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def as_dict(self) -> dict:
        figures = derive(self.figures, self.tau)
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
        text = json.dumps(self.as_dict(), indent=1) + "\n"
        for path in self.paths:
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
    # the commit the caller names first: a copied tree's .git may not be the tree's own
    commit, source = os.environ.get("GPU_CHECK_COMMIT") or None, "GPU_CHECK_COMMIT"
    if commit is None:
        commit, source = first_line(["git", "rev-parse", "HEAD"]), "git"
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


def derive(figures: dict, tau: float | None) -> dict:
    """A copy of the figures with the fractions and ratios that join two parts (null where one
    is missing)."""
    out = json.loads(json.dumps(figures))
    bound_gb_s = (out.get("bandwidth") or {}).get("bound_gb_s")
    for role in ROLES:
        if out.get(f"decode_{role}"):
            derive_decode(out[f"decode_{role}"], bound_gb_s)
    for role in ROLES:
        derive_joins(out, role, tau)
    if tau:
        out["projection"] = {
            "tau": tau,
            "label": "a projection: speculative speed-up = tau (accept length measured on the "
            "CPU for the shipped head) / the round ratio measured here",
        }
    return out


def derive_decode(decode: dict, bound_gb_s: float | None) -> None:
    """A decode part's bandwidth bound, the fractions of it batch 1 reaches, and each batch's
    speed against batch 1."""
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


def derive_joins(out: dict, role: str, tau: float | None) -> None:
    """The `role` shape's speculative round, verify and peer figures against its decode."""
    step = ((out.get(f"decode_{role}") or {}).get("batches") or {}).get("1")
    spec = out.get(f"spec_{role}")
    if spec:
        spec["plain_step_ms"] = step["step_ms"] if step else None
        spec["round_ratio"] = round(spec["round_ms"] / step["step_ms"], 4) if step else None
        if tau and step:
            spec["projected_speedup"] = round(tau / spec["round_ratio"], 3)
    in_turn = out.get(f"in_turn_{role}")
    if in_turn:  # the overlap scheduler's gain: steps in turn against steps launched ahead
        ours = (out.get(f"decode_{role}") or {}).get("batches") or {}
        in_turn["overlap_speedup"] = {
            n: round(row["step_ms"] / ours[n]["step_ms"], 3) if n in ours else None
            for n, row in in_turn["batches"].items()
        }
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
