"""`spectral train-medusa`: train Medusa-1 heads for a target, on a CPU or a GPU.

The target stays frozen; its final-normed hidden states over the training text (teacher-forced)
are the heads' inputs, and head i learns the token i + 2 places after each answer position
(cross-entropy, head i weighted 0.8^i as Medusa weights its heads). Every head starts where
Medusa's do: its LM head a copy of the target's, its residual blocks the identity. The data is
train-eagle3's (`--data` files, or the target's own answers to ShareGPT prompts). The heads are
written to `--out` in the published Medusa-1 layout at every save; work_dir/medusa.pt resumes a
run.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spectral.speculative.drafters.medusa import MedusaHeads, save_medusa_heads
from spectral.training.batching import batches, collate
from spectral.training.config import TrainConfig, config_parser
from spectral.training.train import RunSetup, learning_rate

logger = logging.getLogger(__name__)
HEAD_DECAY = 0.8  # head i's share of the loss: HEAD_DECAY ** i


@dataclass
class MedusaTrainConfig(TrainConfig):
    num_heads: int = 3
    num_layers: int = 1
    lr: float = 1e-3
    warmup_steps: int = 20
    max_steps: int = 400
    batch_tokens: int = 2048
    max_len: int = 512


def head_losses(
    heads: MedusaHeads, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, list[float]]:
    """(weighted loss, top-1 accuracy per head) of the heads on final hidden states `hidden`
    [B, T, H] of token ids `ids` [B, T]: head i at position t against token t + i + 2, where
    that token is an answer token (`mask`)."""
    total = hidden.new_zeros((), dtype=torch.float32)
    accs = []
    for i, head in enumerate(heads.heads):
        shift = i + 2
        if ids.shape[1] <= shift:
            break
        keep = mask[:, shift:]
        if not keep.any():
            accs.append(0.0)
            continue
        logits = head(hidden[:, :-shift][keep]).float()
        target = ids[:, shift:][keep]
        total = total + HEAD_DECAY**i * F.cross_entropy(logits, target)
        accs.append((logits.argmax(-1) == target).float().mean().item())
    return total, accs


def train_medusa(cfg: MedusaTrainConfig) -> MedusaHeads:
    """Train the heads `cfg` describes, resuming work_dir/medusa.pt where there is one; at every
    save, score the held-out samples (`--eval-data`), checkpoint and write `cfg.out`."""
    from transformers import AutoModelForCausalLM

    run = RunSetup.of(cfg)
    device, work, samples, held_out = run.device, run.work, run.samples, run.held_out
    model_dir, target_cfg = run.model_dir, run.target_config
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    heads = MedusaHeads(
        cfg.num_heads, cfg.num_layers, target_cfg.hidden_size, target_cfg.vocab_size
    )
    heads.init_from_lm_head(target.get_output_embeddings().weight.detach().float())
    heads.to(device)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    checkpoint = work / "medusa.pt"
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        logger.info("resuming from %s at step %d", checkpoint, step)

    @torch.no_grad()
    def hidden_states(ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return target.model(input_ids=ids, attention_mask=pad).last_hidden_state.float()

    def save() -> None:
        if held_out:
            heads.eval()
            with torch.no_grad():
                ids, pad, mask = collate(held_out, device)
                _, accs = head_losses(heads, hidden_states(ids, pad), ids, mask)
            heads.train()
            logger.info(
                "step %d, held out: top-1 per head %s", step, "/".join(f"{a:.3f}" for a in accs)
            )
        torch.save(
            {"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
            checkpoint,
        )
        if cfg.out:
            save_medusa_heads(heads, cfg.out, base_model=str(cfg.model_path))

    start = time.monotonic()
    rng = random.Random(cfg.seed + step)
    plan: list = []
    heads.train()
    saved_at = -1
    while step < cfg.max_steps:
        if not plan:
            plan = batches(samples, cfg.batch_tokens, rng)
        ids, pad, mask = collate(plan.pop(), device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        loss, accs = head_losses(heads, hidden_states(ids, pad), ids, mask & pad)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 10 == 0:
            logger.info(
                "step %d loss %.3f top-1 %s", step, loss.item(), "/".join(f"{a:.2f}" for a in accs)
            )
        if step % cfg.save_every == 0:
            save()
            saved_at = step
        if cfg.time_budget is not None and time.monotonic() - start > cfg.time_budget:
            logger.info("time budget spent at step %d", step)
            break
    if saved_at != step:
        save()
    return heads.eval()


def main(argv: list[str] | None = None) -> None:
    # train-eagle3's flags but those of its head and its teacher store
    eagle_only = (
        "init_from",
        "rebuild_vocab",
        "draft_vocab_size",
        "intermediate_size",
        "ttt_steps",
        "cache_teacher",
        "export_dtype",
    )
    parser = config_parser(MedusaTrainConfig, "spectral train-medusa", __doc__, eagle_only)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    train_medusa(MedusaTrainConfig(**vars(ns)))
    if ns.out:
        print(f"wrote the Medusa heads to {ns.out}")
