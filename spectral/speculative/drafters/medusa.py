"""MEDUSA: heads on the target's last (final-normed) hidden state, head i proposing the token
i + 2 places after that state's position (the target's own LM head gives the next one, the
round's root). Their top-k become a tree by EAGLE-2's selection over cumulative log-probability
(`TreeExpansion`), verified like every other draft: greedy by argmax, sampling by the lossless
rejection rule (not Medusa's "typical acceptance", which changes the output).

Heads are read and written in the published Medusa-1 layout: `config.json` with
`medusa_num_heads`, `medusa_num_layers` (and `hidden_size`, `vocab_size`,
`base_model_name_or_path`), and `medusa_lm_head.safetensors` holding, for head i, the residual
blocks `i.j.linear.weight` / `i.j.linear.bias` (x + SiLU(W x + b)) and its LM head `i.L.weight`
(L = medusa_num_layers). A `medusa_head.` prefix on the keys is accepted; pickled `.pt` files are
not read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from spectral.core.forward import ForwardBatch
from spectral.layers.linear import Linear, weight_tensors
from spectral.layers.routing import route_to_cpu_kernels
from spectral.mem.weights import gather
from spectral.speculative.drafters.base import DrafterContext, file_stamp
from spectral.speculative.drafters.expansion import TreeExpansion
from spectral.speculative.drafters.graphs import DraftGraphs, expand_through

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "medusa_lm_head.safetensors"
KEY_PREFIX = "medusa_head."


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """`num_heads` heads of `num_layers` residual blocks and an LM head over `vocab_size`."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(
                f"a Medusa file needs medusa_num_heads >= 1 and medusa_num_layers >= 0 "
                f"(got {num_heads} and {num_layers})"
            )
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.heads = nn.ModuleList(
            nn.Sequential(
                *(ResBlock(hidden_size) for _ in range(num_layers)),
                Linear(hidden_size, vocab_size, bias=False),
            )
            for _ in range(num_heads)
        )

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def forward(self, hidden: torch.Tensor, count: int | None = None) -> list[torch.Tensor]:
        """Float32 logits [T, vocab] of the first `count` heads (all by default)."""
        return [head(hidden).float() for head in self.heads[: count or self.num_heads]]

    def set_cpu_kernels(self, kernels, quantize: str | None = None, int8: bool = False) -> None:
        """Matmuls through spectral's CPU kernels, the weights as GGUF blocks of `quantize`
        where given, through the integer path with `int8` (a draft only proposes;
        verification keeps the output the target's)."""
        route_to_cpu_kernels(self, kernels, quantize, int8)

    def init_from_lm_head(self, lm_head: torch.Tensor) -> None:
        """Medusa's starting point: every head's LM head a copy of the target's, every residual
        block the identity (zero weights: x + SiLU(0) = x)."""
        with torch.no_grad():
            for head in self.heads:
                head[-1].weight.copy_(lm_head[: self.vocab_size])
                for block in list(head)[:-1]:
                    block.linear.weight.zero_()
                    block.linear.bias.zero_()


def save_medusa_heads(heads: MedusaHeads, path: str | Path, base_model: str = "") -> None:
    """Write `heads` to directory `path` in the published Medusa-1 layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": heads.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "base_model_name_or_path": base_model,
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in heads.heads.state_dict().items()}
    save_file(tensors, str(path / WEIGHTS_FILE))


def load_medusa_heads(
    path: str | Path,
    target_hidden_size: int,
    target_vocab_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> MedusaHeads:
    """The heads in directory `path` (published Medusa-1 layout), checked against the target:
    the same hidden size, a vocabulary no larger than the target's."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise FileNotFoundError(
            f"{path} is not a Medusa head directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE} "
            f"(found {found}; pickled .pt heads are not read: convert them to safetensors)"
        )
    config = json.loads(config_file.read_text())
    if "medusa_num_heads" not in config:
        raise ValueError(f"{config_file} has no medusa_num_heads: not a Medusa config")
    tensors = load_file(str(weights_file))
    tensors = {k.removeprefix(KEY_PREFIX): v for k, v in tensors.items()}
    num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    lm_key = f"0.{num_layers}.weight"
    if lm_key not in tensors:
        raise ValueError(
            f"{weights_file} has no {lm_key!r} (head 0's LM head for medusa_num_layers "
            f"{num_layers}): keys {sorted(tensors)[:6]}"
        )
    vocab_size, hidden_size = tensors[lm_key].shape
    if hidden_size != target_hidden_size or vocab_size > target_vocab_size:
        raise ValueError(
            f"the Medusa heads in {path} are for hidden size {hidden_size} and {vocab_size} "
            f"tokens; the target has hidden size {target_hidden_size} and {target_vocab_size} "
            "tokens"
        )
    heads = MedusaHeads(num_heads, num_layers, hidden_size, vocab_size)
    missing, unexpected = heads.heads.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{weights_file} does not match medusa_num_heads {num_heads}, medusa_num_layers "
            f"{num_layers}: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return heads.to(device=device, dtype=dtype).eval()


class MedusaDrafter:
    """Per request row, the target's last hidden state (the one that gave the round's root);
    a draft runs the heads on it. Holds no KV: nothing to allocate, follow or free."""

    capture_layers: tuple[int, ...] = ()
    needs_features = True

    def __init__(
        self, heads: MedusaHeads, rows: int, topk: int, num_steps: int, dtype: torch.dtype, device
    ) -> None:
        if num_steps > heads.num_heads:
            raise ValueError(
                f"--speculative-num-steps {num_steps} exceeds the {heads.num_heads} Medusa "
                "heads (a tree is at most one level a head deep)"
            )
        gather(weight_tensors(heads, buffers=True))  # off 4 KiB pages (spectral/mem/weights.py)
        self.heads = heads
        self.topk = topk
        self.num_steps = num_steps
        self.dummy_row = rows  # the req-to-token table's row of padded requests
        self.last_hidden = torch.zeros((rows + 1, heads.hidden_size), dtype=dtype, device=device)
        self.graphs: DraftGraphs | None = None

    def _keep_last(self, rows: torch.Tensor, lens: list[int], features: torch.Tensor) -> None:
        last = torch.tensor(lens, device=features.device).cumsum(0) - 1
        self.last_hidden[rows] = features[last].to(self.last_hidden.dtype)

    def observe_step(
        self, batch: ForwardBatch, next_ids: list[int], features: torch.Tensor
    ) -> None:
        """A prefill or plain decode step: each request's last hidden state."""
        self._keep_last(batch.req_pool_indices, batch.extend_lens, features)

    def observe_round(
        self,
        batch: ForwardBatch,
        prefix_lens: list[int],
        accepted_tokens: list[list[int]],
        emitted: list[list[int]],
        kept_slots: torch.Tensor,
        features: torch.Tensor,
        drafted: bool = True,
    ) -> None:
        """A verified round: the hidden state at each request's last accepted node (whether
        the heads drafted this round's trees, `drafted`, changes nothing here)."""
        self._keep_last(batch.req_pool_indices, [len(t) for t in accepted_tokens], features)

    def flush(self) -> None:
        """Nothing is deferred: a step's hidden state is kept as it comes."""

    def top1(self, rows: list[int]) -> list[float | None]:
        """Not known before a draft (the heads run only when drafting)."""
        return [None] * len(rows)

    @torch.inference_mode()
    def draft(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        num_steps: int | None = None,
        roots: torch.Tensor | None = None,
        root_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidates below each request's root, level d from head d - 1 (the same proposals
        whatever the parent: Medusa's heads see only the hidden state), the best `topk` of each
        level expanded further; the layout of EagleDrafter.draft."""
        steps = self.num_steps if num_steps is None else max(1, min(num_steps, self.num_steps))
        return expand_through(self.graphs, self.expand, rows, seq_lens, steps)

    def expand(
        self, rows: torch.Tensor, seq_lens: torch.Tensor, steps: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`draft`'s levels, reading nothing on the host (what a CUDA graph holds)."""
        k = self.topk
        top = [
            torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
            for logits in self.heads(self.last_hidden[rows], steps)
        ]
        levels = TreeExpansion(*top[0])
        for step in range(1, steps):
            levels.add_children(*top[step])  # every frontier node: the same head's top-k
            if step < steps - 1:
                levels.advance()
        return levels.result()

    def use_graphs(self, batch_sizes: list[int]) -> dict | None:
        """Draft batches of up to max(batch_sizes) requests through static buffers, one CUDA
        graph per batch size and depth where the drafter runs on a GPU (captured here);
        eagerly through the same buffers elsewhere."""
        self.graphs = DraftGraphs.start(
            self.expand, self.dummy_row, batch_sizes, self.num_steps, self.last_hidden.device
        )
        return self.graphs.summary()


def build(ctx: DrafterContext) -> MedusaDrafter:
    """Medusa heads at --speculative-draft-model-path over the target's last hidden state."""
    spec, target = ctx.spec, ctx.target
    heads = load_medusa_heads(
        spec.draft_model_path,
        target.config.hidden_size,
        target.config.vocab_size,
        target.dtype,
        target.device,
    )
    heads.set_cpu_kernels(target.model.kernels, spec.draft_quantization, target.integer_path)
    drafter = MedusaDrafter(
        heads,
        target.req_to_token.max_requests,
        spec.topk,
        spec.num_steps,
        target.dtype,
        target.device,
    )
    drafter.cost_key = file_stamp(spec.draft_model_path)
    return drafter
