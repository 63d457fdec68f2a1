"""The frozen target as the head's teacher: the captured layers' inputs and the next-token
logits on the draft vocabulary, kept per sample in a store so that the target runs once per
sample."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from spectral.training.config import CHOICES, TrainConfig
from spectral.training.teacher_store import DiskStore, MemoryStore, sample_key
from spectral.training.train_data import Sample


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
    """The teacher's outputs for a batch of samples, through a store of per-sample states: a
    batch whose samples are all stored skips the target's forward. Batches are the same length
    buckets every epoch, so from the second epoch on every batch is a hit (with a `DiskStore`,
    every batch of a later run too). With no store the target runs every time."""

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


def open_store(
    cfg: TrainConfig, teacher: Teacher, model_dir: str
) -> MemoryStore | DiskStore | None:
    """The store `cfg.cache_teacher` names: a `DiskStore` under work_dir/teacher-states refuses
    states that another target, layer set or dtype made."""
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
