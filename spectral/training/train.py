"""`spectral train-eagle3`: train an EAGLE-3 draft head for a target, on a CPU or a GPU.

The frozen target gives the head its inputs and its teacher (`teacher.py`); the loss is
EAGLE-3's training-time test (`ttt.py`). work_dir/checkpoint.pt is written every save_every
steps and at the end, and a rerun with the same work_dir resumes from it. Usage and the
shipped head's runs: docs/training.md.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from spectral.models.config import ModelConfig
from spectral.speculative.drafters.eagle_head import DraftHead
from spectral.training.batching import batches, collate
from spectral.training.config import TrainConfig, config_parser, resolve_device
from spectral.training.draft_vocab import draft_vocabulary, vocabulary_coverage
from spectral.training.evaluate import chain_accept_length, evaluate
from spectral.training.head import export, init_from_export, new_head
from spectral.training.teacher import Teacher, TeacherCache, open_store
from spectral.training.teacher_store import MemoryStore
from spectral.training.train_data import Sample, load_samples, training_files, without_prompts_of
from spectral.training.ttt import ttt_loss

logger = logging.getLogger(__name__)


def load_run_samples(
    cfg: TrainConfig, data: list[str], tokenizer
) -> tuple[list[Sample], list[Sample]]:
    """(training samples from `data`, held-out samples from `cfg.eval_data`); training samples
    that answer a held-out prompt are left out."""
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
    return samples, held_out


@dataclass
class RunSetup:
    """What every training run starts from: its device and work directory (made), the target's
    directory and config, and its training and held-out samples (`training_files`: the target's
    own answers are generated here where the run has no data)."""

    device: torch.device
    work: Path
    model_dir: str
    target_config: ModelConfig
    samples: list[Sample]
    held_out: list[Sample]

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunSetup:
        from transformers import AutoTokenizer

        from spectral.models.resolve import resolve_model_path

        device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        work = Path(cfg.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        model_dir = resolve_model_path(cfg.model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        def start_engine():
            from spectral import Engine

            return Engine(model_path=cfg.model_path, dtype="auto", max_running_requests=64)

        samples, held_out = load_run_samples(cfg, training_files(cfg, start_engine), tokenizer)
        return cls(
            device, work, model_dir, ModelConfig.from_pretrained(model_dir), samples, held_out
        )


def init_head(
    head: DraftHead,
    cfg: TrainConfig,
    samples: list[Sample],
    target_config: ModelConfig,
    teacher: Teacher,
) -> None:
    """Start a run with no checkpoint: from the `--init-from` export (moved to a vocabulary
    rebuilt from `samples` with `--rebuild-vocab`), or fresh on `samples`' vocabulary."""
    if cfg.init_from:
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


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to a tenth at `max_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def start_head(
    head: DraftHead, cfg: TrainConfig, run: RunSetup, teacher: Teacher, checkpoint: Path
) -> tuple[dict | None, int]:
    """Start `head` on the run's device from `checkpoint` where work_dir has one, else as
    `init_head` does; log how much of the samples' answers its draft vocabulary covers.
    Returns (the checkpoint's state or None, the step to go on from)."""
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
    else:
        init_head(head, cfg, run.samples, run.target_config, teacher)
    head.to(run.device)
    coverage = vocabulary_coverage(run.samples, head.t2d.cpu())
    logger.info(
        "%d samples, %d answer tokens; the draft vocabulary covers %.1f%% of them",
        len(run.samples),
        sum(sum(s.loss_mask) for s in run.samples),
        100 * coverage,
    )
    return state, step


def new_optimizer(
    head: DraftHead, cfg: TrainConfig, state: dict | None
) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """(the head's parameters, made trainable; AdamW over them, resumed from `state`'s)."""
    trainable = [p for n, p in head.named_parameters()]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    return trainable, optimizer


def save_checkpoint(
    checkpoint: Path,
    head: DraftHead,
    optimizer: torch.optim.Optimizer,
    step: int,
    cfg: TrainConfig,
) -> None:
    """Write the head, its optimizer and step to `checkpoint` (what a rerun resumes from), and
    export the head to `cfg.out` where given."""
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


def train(cfg: TrainConfig) -> DraftHead:
    """Train the head `cfg` describes, resuming work_dir's checkpoint when there is one; at
    every save, score the held-out samples, checkpoint, and export to `cfg.out`."""
    if cfg.rebuild_vocab and not cfg.init_from:
        raise SystemExit("--rebuild-vocab moves an --init-from head to a new vocabulary")
    run = RunSetup.of(cfg)
    device, held_out = run.device, run.held_out

    head = new_head(run.target_config, cfg)
    teacher = Teacher(run.model_dir, head.cfg.aux_layers, torch.bfloat16, device)
    checkpoint = run.work / "checkpoint.pt"
    state, step = start_head(head, cfg, run, teacher, checkpoint)
    used = torch.arange(cfg.draft_vocab_size, device=device) + head.d2t
    train_teacher = TeacherCache(teacher, open_store(cfg, teacher, run.model_dir))
    eval_teacher = TeacherCache(teacher, MemoryStore()) if held_out else None
    head.set_target(teacher.embed_weight.detach().float(), None)
    trainable, optimizer = new_optimizer(head, cfg, state)

    saved_at = -1

    def save() -> None:
        """Score the held-out samples, checkpoint, and export."""
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
        save_checkpoint(checkpoint, head, optimizer, step, cfg)

    from tqdm import tqdm

    start = time.monotonic()
    epoch_rng = random.Random(cfg.seed + step)
    plan: list[list[Sample]] = []
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train-eagle3", dynamic_ncols=True)
    head.train()
    while step < cfg.max_steps:
        if not plan:
            plan = batches(run.samples, cfg.batch_tokens, epoch_rng)
        batch = plan.pop()
        ids, pad, mask = collate(batch, device)
        features, logits = train_teacher(batch, ids, pad, used)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
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


def main(argv: list[str] | None = None) -> None:
    ns = config_parser(TrainConfig, "spectral train-eagle3", __doc__).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    train(TrainConfig(**vars(ns)))


if __name__ == "__main__":
    main()
