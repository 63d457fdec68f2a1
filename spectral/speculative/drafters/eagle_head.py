"""EAGLE and EAGLE-3 draft heads: one decoder layer that predicts the target's next tokens from
the target's own hidden states (EAGLE-1: its final state; EAGLE-3: three layers' inputs fused
by `fc`, scored over a draft vocabulary of its own). Tensor names are the published
checkpoints', so heads load both ways. `forward` takes an `attend` callable: the head does not
know where its keys and values live (paged KV for serving, a dense causal mask for training).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from spectral.layers.linear import Linear
from spectral.layers.logits import LogitsHead
from spectral.layers.norm import RMSNorm
from spectral.layers.rotary import apply_rotary
from spectral.layers.routing import route_to_cpu_kernels

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DraftHeadConfig:
    kind: str  # "eagle3" | "eagle"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # EAGLE-3 lm_head rows (== vocab_size for EAGLE-1)
    target_hidden_size: int
    fc_bias: bool
    # HF hidden_states indices (input of layer i) of the target layers EAGLE-3 fuses.
    aux_layers: tuple[int, ...] = ()

    @property
    def feature_size(self) -> int:
        """Width of the target feature the head takes on the first step."""
        if self.kind == "eagle3":
            return len(self.aux_layers) * self.target_hidden_size
        return self.target_hidden_size

    @classmethod
    def from_dir(cls, path: str, kind: str, target_num_layers: int) -> DraftHeadConfig:
        """Read a head's config.json (the published EAGLE / EAGLE-3 layout)."""
        file = Path(path) / "config.json"
        if not file.exists():
            raise FileNotFoundError(f"draft head {path!r} has no config.json")
        raw = json.loads(file.read_text())
        hidden = raw["hidden_size"]
        num_heads = raw["num_attention_heads"]
        vocab = raw["vocab_size"]
        aux: tuple[int, ...] = ()
        if kind == "eagle3":
            eagle = raw.get("eagle_config") or {}
            ids = eagle.get("eagle_aux_hidden_state_layer_ids")
            L = target_num_layers
            # Published ids name layer outputs; our capture index i is layer i's input.
            aux = tuple(i + 1 for i in ids) if ids else (2, L // 2, L - 3)
        return cls(
            kind=kind,
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=raw.get("rope_theta", 10000.0),
            vocab_size=vocab,
            draft_vocab_size=raw.get("draft_vocab_size") or vocab,
            target_hidden_size=raw.get("target_hidden_size") or hidden,
            fc_bias=bool(raw.get("bias", kind == "eagle")),
            aux_layers=aux,
        )

    def to_hf_json(self) -> dict:
        """config.json in the published layout (a one-layer LlamaForCausalLM with extras)."""
        out = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "bias": self.fc_bias,
            "spectral_head": asdict(self),
        }
        if self.kind == "eagle3":
            out["draft_vocab_size"] = self.draft_vocab_size
            out["target_hidden_size"] = self.target_hidden_size
            out["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layers],
                "use_aux_hidden_state": True,
            }
        return out


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftHeadConfig, input_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(input_size, q, bias=False)
        self.k_proj = Linear(input_size, kv, bias=False)
        self.v_proj = Linear(input_size, kv, bias=False)
        self.o_proj = Linear(q, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        c = self.cfg
        q = self.q_proj(x).view(-1, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(attend(q, k, v))

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The keys (rotated) and values `forward` would write, and nothing else."""
        c = self.cfg
        k = self.k_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        return apply_rotary(k, cos, sin), v


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The head's decoder layer (`midlayer` in EAGLE-3, `layers.0` in EAGLE-1)."""

    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        eagle3 = cfg.kind == "eagle3"
        if eagle3:
            self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, 2 * H if eagle3 else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)


class DraftHead(nn.Module):
    def __init__(self, cfg: DraftHeadConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        # hidden -> float32 logits: EAGLE-3's own LM head; EAGLE-1's is the target's (set_target).
        self.logits_head: LogitsHead | Callable[[torch.Tensor], torch.Tensor] | None = None
        if cfg.kind == "eagle3":
            self.fc = Linear(cfg.feature_size, H, bias=cfg.fc_bias)
            self.midlayer = DraftLayer(cfg)
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.lm_head = Linear(H, cfg.draft_vocab_size, bias=False)
            self.logits_head = LogitsHead(self._lm_head_weight)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        elif cfg.kind == "eagle":
            self.fc = Linear(2 * H, H, bias=cfg.fc_bias)
            self.layers = nn.ModuleList([DraftLayer(cfg)])
        else:
            raise ValueError(f"draft head kind must be eagle or eagle3 (got {cfg.kind!r})")
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim)
        )
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        self.embed: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def layer(self) -> DraftLayer:
        return self.midlayer if self.cfg.kind == "eagle3" else self.layers[0]

    def _lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def set_cpu_kernels(
        self, kernels: ModuleType | None, quantize: str | None = None, int8: bool = False
    ) -> None:
        """Small matmuls and norms through spectral's CPU kernels (inference only), the
        weights quantized to GGUF blocks of type `quantize` where given, through the integer
        path with `int8` (a draft only proposes: verification keeps the output the
        target's)."""
        route_to_cpu_kernels(self, kernels, quantize, int8)
        if self.cfg.kind == "eagle3":
            self.logits_head.set_kernels(kernels, self.lm_head.packed)

    def set_target(
        self,
        embed: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
        logits: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        """Share the target's embedding (and, for EAGLE-1, its LM head), as weights or as the
        target's own functions (ids -> embeddings, hidden -> float32 logits); not saved."""
        self.embed = embed if callable(embed) else functools.partial(F.embedding, weight=embed)
        if self.cfg.kind == "eagle":
            self.logits_head = logits if logits is None or callable(logits) else LogitsHead(logits)

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """Pre-norm output [T, H] for tokens `input_ids` (target ids) paired with `features`:
        the target feature ([T, feature_size]) on a round's first step, or the head's own
        previous output ([T, H]) after that. Position t pairs feature t with token t + 1."""
        layer = self.layer
        x, residual, cos, sin = self._layer_input(input_ids, features, positions)
        h = residual + layer.self_attn(x, cos, sin, attend)
        return h + layer.mlp(layer.post_attention_layernorm(h)[0])

    def kv(
        self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values `forward` would write for these positions, computed alone (a
        fraction of the head's work: no attention, MLP or LM head)."""
        x, _, cos, sin = self._layer_input(input_ids, features, positions)
        return self.layer.self_attn.kv(x, cos, sin)

    def _layer_input(
        self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(attention input, residual, cos, sin) of the decoder layer."""
        cfg = self.cfg
        layer = self.layer
        emb = self.embed(input_ids).to(features.dtype)
        if cfg.kind == "eagle3":
            if features.shape[-1] != cfg.hidden_size:
                features = self.fc(features)
            residual = features
            x = torch.cat((layer.input_layernorm(emb)[0], layer.hidden_norm(features)[0]), -1)
        else:
            x = self.fc(torch.cat((emb, features), dim=-1))
            residual = x
        cos = self.rope_cos[positions].to(x.dtype)[:, None, :]
        sin = self.rope_sin[positions].to(x.dtype)[:, None, :]
        return x, residual, cos, sin

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary (EAGLE-1: the target's vocabulary)."""
        if self.cfg.kind == "eagle3":
            hidden = self.norm(hidden)[0]
        return self.logits_head(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.kind == "eagle3":
            return draft_ids + self.d2t[draft_ids]
        return draft_ids

    # ---- files -------------------------------------------------------------------------------

    def save(self, path: str) -> None:
        """Write config.json and model.safetensors in the published layout."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.cfg.to_hf_json(), indent=2) + "\n")
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / "model.safetensors"))


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_draft_head(
    path: str,
    kind: str,
    target_hidden_size: int,
    target_vocab_size: int,
    target_num_layers: int,
    max_positions: int,
    dtype: torch.dtype,
    device: str = "cpu",
) -> DraftHead:
    """Load a head and check it fits the target; errors say what differs."""
    cfg = DraftHeadConfig.from_dir(path, kind, target_num_layers)
    tensors = _read_tensors(path)
    if not tensors:
        raise FileNotFoundError(f"draft head {path!r} has no .safetensors file")
    has_midlayer = any(n.startswith("midlayer.") for n in tensors)
    if kind == "eagle3" and not has_midlayer:
        raise ValueError(f"{path} is not an EAGLE-3 head (no midlayer.* tensors); use EAGLE")
    if kind == "eagle" and has_midlayer:
        raise ValueError(f"{path} is an EAGLE-3 head; use --speculative-algorithm EAGLE3")
    if cfg.vocab_size != target_vocab_size:
        raise ValueError(
            f"draft head vocabulary {cfg.vocab_size} != target vocabulary {target_vocab_size}"
        )
    if cfg.target_hidden_size != target_hidden_size:
        raise ValueError(
            f"draft head expects target hidden size {cfg.target_hidden_size}, "
            f"the target has {target_hidden_size}"
        )
    if kind == "eagle3" and "fc.weight" in tensors:
        fc_in = tensors["fc.weight"].shape[1]
        if fc_in != cfg.feature_size:
            raise ValueError(
                f"draft head fc takes {fc_in} features, expected {cfg.feature_size} "
                f"({len(cfg.aux_layers)} target layers of {target_hidden_size})"
            )
    if cfg.aux_layers and max(cfg.aux_layers) > target_num_layers:
        raise ValueError(
            f"draft head captures layers {cfg.aux_layers}; the target has {target_num_layers}"
        )
    head = DraftHead(cfg, max_positions)
    state = head.state_dict()
    loaded = {k: v for k, v in tensors.items() if k in state}
    unexpected = sorted(k for k in tensors if k not in state and k != "embed_tokens.weight")
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors {', '.join(unexpected[:5])}")
    missing = sorted(k for k in state if k not in loaded and k not in ("t2d",))
    if missing:
        raise ValueError(f"{path}: tensors missing: {', '.join(missing[:5])}")
    for name, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(state[name].shape)}"
            )
    head.load_state_dict(loaded, strict=False)
    head = head.to(device=device, dtype=dtype)
    if kind == "eagle3":
        head.d2t = head.d2t.to(torch.int64)
        head.t2d = head.t2d.to(torch.bool)
        if "t2d" not in loaded:  # derive it from d2t
            head.t2d.zero_()
            head.t2d[torch.arange(cfg.draft_vocab_size) + head.d2t] = True
    head.requires_grad_(False)
    head.eval()
    return head


DEFAULT_HEAD_DIR = Path(__file__).resolve().parents[2] / "assets" / "eagle3-smollm2-135m"


def resolve_draft_path(path: str) -> str:
    """A head directory; 'default' is the head shipped for the default model."""
    if path == "default":
        if not (DEFAULT_HEAD_DIR / "config.json").exists():
            raise FileNotFoundError(
                "no default draft head is installed with this build; pass a head directory"
            )
        return str(DEFAULT_HEAD_DIR)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"draft head directory {path!r} does not exist")
    return path
