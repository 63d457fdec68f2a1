"""Train an EAGLE-3 draft head for a target model on a CPU (or GPU): `spectral train-eagle3`.

The target (frozen, transformers) runs on the fly over each batch and gives the head its
inputs (the three captured layers) and its teacher (the target's next-token distribution on
the draft vocabulary); its states are kept per sample (`cache_teacher`: in memory for this
run, or on disk for later runs too), so it runs once per sample. The loss is the training-time
test of EAGLE-3: the head is unrolled `ttt_steps` times, step s feeding its own output back as
the feature and predicting s + 1 tokens further ahead, attending to the real prefix and to its
own earlier steps at the same position, exactly the context a draft tree gives it; step losses
are weighted 0.8^s (`ttt.py`).

Checkpoints (head, optimiser, step, vocabulary) go to `work_dir/checkpoint.pt` every
`save_every` steps and at the end; a rerun with the same work_dir resumes from there. The head
is exported in the published EAGLE-3 layout (config.json + model.safetensors).

    spectral train-eagle3 --work-dir .train --out spectral/assets/eagle3-smollm2-135m \\
        --num-prompts 3000 --time-budget 3600
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spectral.models.config import ModelConfig
from spectral.speculative.eagle_head import DraftHead, DraftHeadConfig, load_draft_head
from spectral.training.teacher_store import DiskStore, MemoryStore, sample_key
from spectral.training.train_data import (
    Sample,
    generate_answers,
    generate_second_turns,
    load_samples,
    without_prompts_of,
)
from spectral.training.ttt import ttt_loss

logger = logging.getLogger(__name__)


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


# ---- the target's side ----------------------------------------------------------------------


class Teacher:
    """The frozen target: captured layer inputs and next-token logits on the draft vocab."""

    def __init__(
        self,
        model_dir: str,
        aux_layers: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = model.to(device).eval()
        self.aux_layers = aux_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @torch.no_grad()
    def states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured layers' inputs [B, T, 3H] and the final hidden state [B, T, H], in the
        teacher's dtype (what `TeacherCache` keeps)."""
        out = self.model.model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True
        )
        features = torch.cat([out.hidden_states[i] for i in self.aux_layers], dim=-1)
        return features, out.last_hidden_state

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
        lm_head = self.model.get_output_embeddings().weight[used]
        return F.linear(last_hidden, lm_head).float()

    @torch.no_grad()
    def top_tokens(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's top token over its whole vocabulary at each position."""
        lm_head = self.model.get_output_embeddings().weight
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        top = torch.cat([F.linear(rows, lm_head).argmax(-1) for rows in flat.split(1024)])
        return top.view(last_hidden.shape[:-1])


class TeacherCache:
    """The teacher's outputs for a batch of samples, through a store of per-sample states
    (`teacher_store`): a batch whose samples are all stored skips the target's forward (about
    half a step on a CPU). Batches are the same length buckets every epoch, so from the second
    epoch on every batch is a hit; with a `DiskStore`, so is every batch of a later run. With no
    store the target runs every time."""

    def __init__(self, teacher: Teacher, store: MemoryStore | DiskStore | None) -> None:
        self.teacher = teacher
        self.store = store
        self.top: dict[str, torch.Tensor] = {}  # the target's top tokens, per sample key

    def __call__(
        self, batch: list[Sample], input_ids: torch.Tensor, pad: torch.Tensor, used: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [B, T, 3H] float32, teacher logits over the draft vocab [B, T, N])."""
        features, last = self.states(batch, input_ids, pad)
        return features, self.teacher.logits(last, used)

    def states(
        self, batch: list[Sample], input_ids: torch.Tensor, pad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [B, T, 3H] float32, the target's final hidden states [B, T, H])."""
        store = self.store
        keys = [sample_key(s.input_ids) for s in batch] if store is not None else []
        if keys and all(k in store for k in keys):
            rows = [store.get(k) for k in keys]
            states = rows[0].new_zeros(*input_ids.shape, rows[0].shape[-1])
            for i, row in enumerate(rows):
                states[i, : row.shape[0]] = row
            states = states.to(input_ids.device, non_blocking=True)
            H = self.teacher.hidden_size
            features, last = states[..., :-H], states[..., -H:]
        else:
            features, last = self.teacher.states(input_ids, pad.long())
            for i, (k, s) in enumerate(zip(keys, batch)):
                n = len(s.input_ids)
                store.put(k, torch.cat((features[i, :n], last[i, :n]), dim=-1).cpu())
        return features.float(), last

    def top_tokens(self, batch: list[Sample], last: torch.Tensor) -> torch.Tensor:
        """`Teacher.top_tokens` for a batch [B, T] (0 at padding, which is never scored),
        kept per sample: held-out samples are scored at every save, and a pass over the whole
        vocabulary costs more than the head's forward."""
        keys = [sample_key(s.input_ids) for s in batch]
        missing = [i for i, k in enumerate(keys) if k not in self.top]
        if missing:
            fresh = self.teacher.top_tokens(last[missing])
            for i, row in zip(missing, fresh):
                self.top[keys[i]] = row[: len(batch[i].input_ids)]
        out = torch.zeros(last.shape[:-1], dtype=torch.int64, device=last.device)
        for i, k in enumerate(keys):
            out[i, : self.top[k].shape[0]] = self.top[k]
        return out


def index_of(ids: torch.Tensor, size: int) -> torch.Tensor:
    """[size]: the position of each id in `ids`, -1 for ids it lacks (e.g. target token ->
    draft index)."""
    where = torch.full((size,), -1, dtype=torch.int64, device=ids.device)
    where[ids] = torch.arange(ids.numel(), device=ids.device)
    return where


CHOICES = {
    "cache_teacher": ("memory", "disk", "off"),
    "export_dtype": ("bfloat16", "float16", "float32"),
}


def teacher_store(
    cfg: TrainConfig, teacher: Teacher, model_dir: str
) -> MemoryStore | DiskStore | None:
    if cfg.cache_teacher == "memory":
        return MemoryStore()
    if cfg.cache_teacher == "disk":
        meta = {
            "target": str(Path(model_dir).resolve()),
            "aux_layers": list(teacher.aux_layers),
            "dtype": str(teacher.model.dtype).removeprefix("torch."),
            "width": (len(teacher.aux_layers) + 1) * teacher.hidden_size,
        }
        return DiskStore(Path(cfg.work_dir) / "teacher-states", meta)
    if cfg.cache_teacher == "off":
        return None
    raise SystemExit(
        f"cache_teacher must be one of {CHOICES['cache_teacher']} (got {cfg.cache_teacher!r})"
    )


def draft_vocabulary(
    samples: list[Sample], size: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the `size` most frequent answer tokens, in ascending id order."""
    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(t for t, m in zip(s.input_ids, s.loss_mask) if m)
    top = [t for t, _ in counts.most_common(size)]
    if len(top) < size:  # small data: fill with the lowest unused ids
        taken = set(top)
        top += [t for t in range(vocab_size) if t not in taken][: size - len(top)]
    used = torch.tensor(sorted(top), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(size), t2d


def vocabulary_coverage(samples: list[Sample], t2d: torch.Tensor) -> float:
    """Share of the answer tokens that the draft vocabulary `t2d` holds."""
    answer = [t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m]
    if not answer:
        return 0.0
    return float(t2d[torch.tensor(answer)].float().mean())


def init_from_export(
    head: DraftHead,
    path: str,
    target_config: ModelConfig,
    vocabulary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Load an exported head's weights and vocabulary into `head` (float32), through the
    loader serving uses. A narrower MLP is widened without changing what the head computes
    (the new units' down-projection starts at zero), so a longer run can test a wider head
    without starting over. With `vocabulary` = (d2t, t2d, the target's output rows) the head
    moves to that draft vocabulary, of any size (`remap_output_rows`). Any other difference in
    shape is refused."""
    try:
        loaded = load_draft_head(
            path,
            "eagle3",
            target_hidden_size=target_config.hidden_size,
            target_vocab_size=target_config.vocab_size,
            target_num_layers=target_config.num_layers,
            max_positions=2,
            dtype=torch.float32,
        )
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"--init-from {path}: {err}") from err
    ours, theirs = head.cfg, loaded.cfg
    checked = ("intermediate_size", "aux_layers") + (() if vocabulary else ("draft_vocab_size",))
    for name in checked:
        mine, its = getattr(ours, name), getattr(theirs, name)
        if mine != its and not (name == "intermediate_size" and its < mine):
            raise SystemExit(
                f"--init-from {path}: its {name} is {its}, this run's is {mine} (same target, "
                "the same --draft-vocab-size or --rebuild-vocab, and an --intermediate-size no "
                "smaller than its?)"
            )
    state = {name: value.clone() for name, value in head.state_dict().items()}
    vocab_entries = ("lm_head.weight", "d2t", "t2d")
    with torch.no_grad():
        for name, value in loaded.state_dict().items():
            if vocabulary is not None and name in vocab_entries:
                continue
            if name.endswith("mlp.down_proj.weight"):
                state[name].zero_()
            state[name][tuple(slice(0, n) for n in value.shape)] = value
        if vocabulary is not None:
            d2t, t2d, target_out = vocabulary
            old = torch.arange(theirs.draft_vocab_size) + loaded.d2t
            new = torch.arange(ours.draft_vocab_size) + d2t
            state["lm_head.weight"] = remap_output_rows(loaded.lm_head.weight, old, new, target_out)
            state["d2t"], state["t2d"] = d2t, t2d
            kept = int(loaded.t2d[new].sum())
            logger.info(
                "new draft vocabulary: %d tokens, %d of them the head's, %d fitted",
                len(new),
                kept,
                len(new) - kept,
            )
    head.load_state_dict(state)


def remap_output_rows(
    rows: torch.Tensor, old_ids: torch.Tensor, new_ids: torch.Tensor, target_out: torch.Tensor
) -> torch.Tensor:
    """A head's output rows for the draft vocabulary `new_ids` (target token ids) from its
    `rows` for `old_ids`: a token it has keeps its row; a new token gets the target's output
    row for it, mapped into the head's space by the linear least-squares fit of the head's
    rows on the target's rows for `old_ids` (the head learns to predict what the target's
    final state predicts, so the two sets of rows are close to linearly related)."""
    rows = rows.detach().float()
    target_out = target_out.detach().float()
    fit = torch.linalg.lstsq(target_out[old_ids], rows).solution
    out = target_out[new_ids] @ fit
    where = index_of(old_ids, target_out.shape[0])[new_ids]
    have = where >= 0
    out[have] = rows[where[have]]
    return out


# ---- the loop --------------------------------------------------------------------------------


def batches(samples: list[Sample], batch_tokens: int, rng: random.Random) -> list[list[Sample]]:
    """Length-bucketed batches of at most `batch_tokens` padded tokens, in random order."""
    order = sorted(samples, key=lambda s: len(s.input_ids))
    out: list[list[Sample]] = []
    current: list[Sample] = []
    for s in order:
        if current and (len(current) + 1) * len(s.input_ids) > batch_tokens:
            out.append(current)
            current = []
        current.append(s)
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def collate(
    batch: list[Sample], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, which are not padding, which are answer tokens), [B, T] on `device`."""
    T = max(len(s.input_ids) for s in batch)
    ids = torch.zeros((len(batch), T), dtype=torch.int64)
    pad = torch.zeros((len(batch), T), dtype=torch.bool)
    mask = torch.zeros((len(batch), T), dtype=torch.bool)
    for i, s in enumerate(batch):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        pad[i, :n] = True
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
    return ids.to(device), pad.to(device), mask.to(device)


@torch.no_grad()
def evaluate(
    head: DraftHead,
    teacher: TeacherCache,
    samples: list[Sample],
    used: torch.Tensor,
    steps: int,
    batch_tokens: int,
) -> list[float]:
    """Per-step top-1 agreement with the target on `samples` (the training-time test, over
    every answer token), in eval mode and without gradients. A step counts as right only when
    the head picks the target's top token over the target's whole vocabulary, as a verifier
    would accept it: a token outside the draft vocabulary is a miss, so this also measures
    what the vocabulary's size costs."""
    hits = [0.0] * steps
    counts = [0] * steps
    draft_index = index_of(used, head.cfg.vocab_size)
    was_training = head.training
    head.eval()
    for batch in batches(samples, batch_tokens, random.Random(0)):
        ids, pad, mask = collate(batch, used.device)
        features, last = teacher.states(batch, ids, pad)
        logits = teacher.teacher.logits(last, used)
        choice = draft_index[teacher.top_tokens(batch, last)]
        _, accs, ns = ttt_loss(head, ids, pad, mask, features, logits, steps, choice)
        for s, (a, n) in enumerate(zip(accs, ns)):
            hits[s] += a * n
            counts[s] += n
    head.train(was_training)
    return [h / max(n, 1) for h, n in zip(hits, counts)]


def chain_accept_length(accs: list[float]) -> float:
    """τ of a one-path draft whose steps agree with the target with these probabilities,
    taken as independent: 1 + a0 + a0·a1 + ..."""
    tau, reach = 1.0, 1.0
    for a in accs:
        reach *= a
        tau += reach
    return tau


def new_head(target_config, cfg: TrainConfig) -> DraftHead:
    L = target_config.num_layers
    head_cfg = DraftHeadConfig(
        kind="eagle3",
        hidden_size=target_config.hidden_size,
        intermediate_size=cfg.intermediate_size or target_config.intermediate_size,
        num_heads=target_config.num_heads,
        num_kv_heads=target_config.num_kv_heads,
        head_dim=target_config.head_dim,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=float(getattr(target_config.hf_config, "rope_theta", 10000.0) or 10000.0),
        vocab_size=target_config.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=target_config.hidden_size,
        fc_bias=False,
        aux_layers=(2, L // 2, L - 3),
    )
    return DraftHead(head_cfg, max_positions=cfg.max_len + cfg.ttt_steps + 1)


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


def training_files(
    cfg: TrainConfig, make_engine: Callable[[], Any], sharegpt_path: str | None = None
) -> list[str]:
    """The files a run trains on: `cfg.data`, or without it the target's answers (greedy, or
    sampled at `cfg.temperature`) to ShareGPT first turns (`work_dir/sharegpt-answers.jsonl`);
    with `second_turns` also the target's answers to the second user turns of the ShareGPT
    conversations whose first answers those files hold (`work_dir/sharegpt-second-turns.jsonl`,
    listed once even when `cfg.data` names it). The engine (`make_engine()`) starts only for a
    run that generates (no `cfg.data`, or `second_turns`); a rerun appends only what is missing."""
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


def train(cfg: TrainConfig) -> DraftHead:
    from transformers import AutoTokenizer

    from spectral.models.resolve import resolve_model_path

    if cfg.rebuild_vocab and not cfg.init_from:
        raise SystemExit("--rebuild-vocab moves an --init-from head to a new vocabulary")
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(cfg.model_path)
    target_config = ModelConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def start_engine():
        from spectral import Engine

        return Engine(model_path=cfg.model_path, dtype="auto", max_running_requests=64)

    data = training_files(cfg, start_engine)
    held_out = load_samples(cfg.eval_data, tokenizer, cfg.max_len)
    if cfg.eval_data and not held_out:
        raise SystemExit(f"no evaluation samples in {', '.join(cfg.eval_data)}")
    loaded = load_samples(data, tokenizer, cfg.max_len)
    samples = without_prompts_of(loaded, held_out)
    if len(samples) < len(loaded):
        logger.info(
            "%d training samples answer held-out prompts: left out", len(loaded) - len(samples)
        )
    if not samples:
        raise SystemExit(f"no training samples in {', '.join(data)}")

    head = new_head(target_config, cfg)
    teacher = Teacher(model_dir, head.cfg.aux_layers, torch.bfloat16, device)
    checkpoint = work / "checkpoint.pt"
    state = (
        torch.load(checkpoint, map_location="cpu", weights_only=False)
        if checkpoint.exists()
        else None
    )
    step = 0
    if state is not None:
        head.load_state_dict(state["head"])
        step = state["step"]
        logger.info("resuming from %s at step %d", checkpoint, step)
    elif cfg.init_from:
        vocabulary = None
        if cfg.rebuild_vocab:
            d2t, t2d = draft_vocabulary(samples, cfg.draft_vocab_size, target_config.vocab_size)
            vocabulary = (d2t, t2d, teacher.model.get_output_embeddings().weight.cpu())
        init_from_export(head, cfg.init_from, target_config, vocabulary)
        logger.info("starting from the head in %s", cfg.init_from)
    else:
        d2t, t2d = draft_vocabulary(samples, cfg.draft_vocab_size, target_config.vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    head.to(device)
    coverage = vocabulary_coverage(samples, head.t2d.cpu())
    logger.info(
        "%d samples, %d answer tokens; the draft vocabulary covers %.1f%% of them",
        len(samples),
        sum(sum(s.loss_mask) for s in samples),
        100 * coverage,
    )
    used = torch.arange(cfg.draft_vocab_size, device=device) + head.d2t
    train_teacher = TeacherCache(teacher, teacher_store(cfg, teacher, model_dir))
    eval_teacher = TeacherCache(teacher, MemoryStore()) if held_out else None
    head.set_target(teacher.embed_weight.detach().float(), None)
    trainable = [p for n, p in head.named_parameters()]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])

    def lr_at(i: int) -> float:
        if i < cfg.warmup_steps:
            return cfg.lr * (i + 1) / cfg.warmup_steps
        frac = (i - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    saved_at = -1

    def save() -> None:
        """Checkpoint, export, and score the held-out samples."""
        nonlocal saved_at
        saved_at = step
        if eval_teacher is not None:
            accs = evaluate(head, eval_teacher, held_out, used, cfg.ttt_steps, cfg.batch_tokens)
            logger.info(
                "step %d, held out: top-1 agreement %s, chain τ %.2f",
                step,
                "/".join(f"{a:.3f}" for a in accs),
                chain_accept_length(accs),
            )
        torch.save(
            {
                "head": head.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "config": asdict(cfg),
            },
            checkpoint,
        )
        if cfg.out:
            export(head, cfg.out, getattr(torch, cfg.export_dtype))

    from tqdm import tqdm

    start = time.monotonic()
    epoch_rng = random.Random(cfg.seed + step)
    plan: list[list[Sample]] = []
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train-eagle3", dynamic_ncols=True)
    head.train()
    while step < cfg.max_steps:
        if not plan:
            plan = batches(samples, cfg.batch_tokens, epoch_rng)
        batch = plan.pop()
        ids, pad, mask = collate(batch, device)
        features, logits = train_teacher(batch, ids, pad, used)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, accs, _ = ttt_loss(head, ids, pad, mask, features, logits, cfg.ttt_steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs[:4]))
        if step % cfg.save_every == 0:
            save()
        if cfg.time_budget is not None and time.monotonic() - start > cfg.time_budget:
            logger.info("time budget spent at step %d", step)
            break
    bar.close()
    if saved_at != step:
        save()
    head.eval()
    return head


def export(head: DraftHead, out: str, dtype: torch.dtype) -> None:
    """Write the head in the published EAGLE-3 layout (config.json + model.safetensors)."""
    copy = DraftHead(head.cfg, max_positions=2)
    copy.load_state_dict(head.state_dict())
    copy.to(dtype)
    copy.d2t = head.d2t.cpu().clone()
    copy.t2d = head.t2d.cpu().clone()
    copy.save(out)
    logger.info("exported the head to %s", out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="spectral train-eagle3", description=__doc__)
    defaults = TrainConfig()
    for name, value in asdict(defaults).items():
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
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    train(TrainConfig(**vars(ns)))


if __name__ == "__main__":
    main()
