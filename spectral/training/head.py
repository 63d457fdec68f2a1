"""The head a run trains: made for the target (`new_head`), started from an exported head
(`init_from_export`), and written in the published EAGLE-3 layout (`export`)."""

from __future__ import annotations

import logging

import torch

from spectral.models.config import ModelConfig
from spectral.speculative.drafters.eagle_head import DraftHead, DraftHeadConfig, load_draft_head
from spectral.training.config import TrainConfig
from spectral.training.draft_vocab import remap_output_rows

logger = logging.getLogger(__name__)


def new_head(target_config: ModelConfig, cfg: TrainConfig) -> DraftHead:
    """A fresh EAGLE-3 head of the target's shape, capturing layers 2, L/2 and L-3."""
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


def init_from_export(
    head: DraftHead,
    path: str,
    target_config: ModelConfig,
    vocabulary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Load an exported head's weights and vocabulary into `head` (float32), through serving's
    loader. A narrower MLP is widened without changing what the head computes (the new units'
    down-projection starts at zero). With `vocabulary` = (d2t, t2d, the target's output rows)
    the head moves to that draft vocabulary, of any size. Any other difference in shape is
    refused."""
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


def export(head: DraftHead, out: str, dtype: torch.dtype) -> None:
    """Write the head in the published EAGLE-3 layout (config.json + model.safetensors)."""
    copy = DraftHead(head.cfg, max_positions=2)
    copy.load_state_dict(head.state_dict())
    copy.to(dtype)
    copy.d2t = head.d2t.cpu().clone()
    copy.t2d = head.t2d.cpu().clone()
    copy.save(out)
    logger.info("exported the head to %s", out)
