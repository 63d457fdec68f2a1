"""What a `spectral train-eagle3` run is told: `TrainConfig`, one field per flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

import torch


@dataclass
class TrainConfig:
    model_path: str = "default"
    work_dir: str = ".train"
    out: str | None = None
    init_from: str | None = None  # an exported head to start from (weights and vocabulary)
    # with init_from: a new draft vocabulary from this run's data (--draft-vocab-size tokens);
    # tokens the head has keep their output rows, new ones get a fitted one
    rebuild_vocab: bool = False
    data: list[str] = field(default_factory=list)  # user files; empty: self-distilled ShareGPT
    eval_data: list[str] = field(default_factory=list)  # held-out samples, scored at each save
    num_prompts: int = 2000
    skip_prompts: int = 0  # ShareGPT first turns before these are not answered
    # also answer the second user turns of the ShareGPT conversations whose first answers the
    # data holds (generated or --data), after that answer (work_dir/sharegpt-second-turns.jsonl)
    second_turns: bool = False
    max_new_tokens: int = 384
    # sampling temperature of the self-distilled answers (0: greedy); a sampled answer is new
    # text from the target's distribution for a prompt whose greedy answer the data has
    temperature: float = 0.0
    draft_vocab_size: int = 8192
    intermediate_size: int | None = None  # default: the target's
    ttt_steps: int = 7
    max_len: int = 768
    batch_tokens: int = 4096
    lr: float = 5e-4
    warmup_steps: int = 100
    max_steps: int = 4000
    time_budget: float | None = None  # seconds; stop (and save) when spent
    save_every: int = 100
    seed: int = 0
    # where the target's states are kept between epochs: "memory" (this run), "disk" (also
    # later runs over the same data: work_dir/teacher-states, 4H values a token), or "off"
    cache_teacher: str = "memory"
    export_dtype: str = "bfloat16"
    # where the target and the head run: "auto" (a GPU when torch sees one), "cpu", "cuda",
    # "cuda:1", ...
    device: str = "auto"


CHOICES = {
    "cache_teacher": ("memory", "disk", "off"),
    "export_dtype": ("bfloat16", "float16", "float32"),
}


def resolve_device(name: str) -> torch.device:
    """`TrainConfig.device` as a torch device; "auto" is the GPU when torch sees one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise SystemExit(f"--device {name!r}: {err} (auto, cpu, cuda, cuda:N)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: this torch sees no GPU (use cpu or auto)")
    return device


def config_parser(
    config: type[TrainConfig], prog: str, description: str | None, skip: tuple[str, ...] = ()
) -> argparse.ArgumentParser:
    """A command line with one flag per field of `config` (a TrainConfig), but those in
    `skip`, defaulting to the field's default; `config(**vars(parser.parse_args()))` builds it."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    defaults = config()
    for f in fields(config):
        if f.name in skip:
            continue
        name, value = f.name, getattr(defaults, f.name)
        flag = "--" + name.replace("_", "-")
        if name in ("data", "eval_data"):
            parser.add_argument(flag, nargs="*", default=[], help="text/JSONL files")
        elif isinstance(value, bool):
            parser.add_argument(flag, action="store_true")
        else:
            kind = type(value) if value is not None else (float if name == "time_budget" else str)
            if name == "intermediate_size":
                kind = int
            parser.add_argument(flag, type=kind, default=value, choices=CHOICES.get(name))
    return parser
