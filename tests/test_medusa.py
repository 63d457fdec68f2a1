"""MEDUSA speculation in the scheduler: greedy output identical token for token to plain decoding
(float32) at batch 1 and 8, with and without grammars, nothing leaked; a chi-squared test of
sampled output against plain sampling, with a control that bypasses verification and fails it;
heads read and written in the published Medusa-1 layout; bad head directories refused with a
message."""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from spectral.models.config import ModelConfig
from spectral.speculative.drafters.medusa import (
    WEIGHTS_FILE,
    MedusaHeads,
    load_medusa_heads,
    save_medusa_heads,
)
from tests.conftest import make_tiny_model, scheduler_leaks
from tests.test_speculative import make_spec_scheduler, plain_outputs, prompts, run
from tests.test_standalone import (
    CASES,
    check_grammars_keep_greedy_output,
    check_greedy_case,
    check_sampling_and_control,
)

__all__ = ["plain_outputs"]  # the fixture, shared with tests/test_speculative.py


def random_heads(model_dir: str, path: Path, num_heads: int = 4, seed: int = 0) -> str:
    """Medusa heads for the model at `model_dir`, written to `path`: Medusa's starting point
    (each LM head the target's, so that drafts are sometimes right) with random residual
    blocks."""
    cfg = ModelConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, 1, cfg.hidden_size, cfg.vocab_size)
    target = load_file(str(next(Path(model_dir).glob("*.safetensors"))))
    heads.init_from_lm_head(target.get("lm_head.weight", target["model.embed_tokens.weight"]))
    with torch.no_grad():
        for head in heads.heads:
            head[0].linear.weight.normal_(0.0, 0.3 / cfg.hidden_size**0.5)
            head[0].linear.bias.normal_(0.0, 0.3)
    save_medusa_heads(heads, path, base_model=model_dir)
    return str(path)


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory: pytest.TempPathFactory, peaky_model_dir: str) -> str:
    return random_heads(peaky_model_dir, tmp_path_factory.mktemp("medusa"))


def medusa(model_dir: str, heads: str, **options):
    """MEDUSA alone unless `options` add n-gram trees."""
    options.setdefault("speculative_hybrid_ngram", 0)
    return make_spec_scheduler(
        model_dir, speculative_algorithm="MEDUSA", speculative_draft_model_path=heads, **options
    )


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_decoding(
    case: str, peaky_model_dir: str, heads_dir: str, plain_outputs: list[list[int]]
) -> None:
    """On a model of the tokenizer's vocabulary, where these heads' drafts are mostly wrong."""
    s = check_greedy_case(
        functools.partial(medusa, peaky_model_dir, heads_dir), CASES[case], plain_outputs
    )
    assert not scheduler_leaks(s)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_decoding_where_drafts_are_accepted(
    case: str, small_vocab_model_dir: str, tmp_path: Path
) -> None:
    """On a model of 16 tokens, where many of the same kind of heads' drafts are right."""
    heads = random_heads(small_vocab_model_dir, tmp_path / "heads", seed=1)
    make = functools.partial(medusa, small_vocab_model_dir, heads)
    check_small_vocab_greedy(small_vocab_model_dir, make, CASES[case])


def check_small_vocab_greedy(model_dir: str, make, case: dict) -> None:
    """On the 16-token model: `make(**options)`'s greedy output (`case`: options and
    `at_once`) is plain decoding's, its rounds accepting drafts, nothing leaked."""
    opts = dict(case)
    at_once = opts.pop("at_once")
    batch = [[t % 16 for t in p] for p in prompts(12, seed=4)]
    plain = run(make_spec_scheduler(model_dir), batch, temperature=0.0, ignore_eos=True)
    s = make(**opts)
    reqs = run(s, batch, at_once=at_once, temperature=0.0, ignore_eos=True)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert s.stats.spec_emitted_tokens > 1.3 * s.stats.spec_verify_ct  # drafts were accepted
    assert not scheduler_leaks(s)


def test_grammars_keep_greedy_output_equal(peaky_model_dir: str, heads_dir: str) -> None:
    check_grammars_keep_greedy_output(peaky_model_dir, medusa(peaky_model_dir, heads_dir))


@pytest.fixture(scope="module")
def small_vocab_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """A tiny model over 16 tokens: random heads' top 3 hold the sampled token often enough for
    rounds to accept drafts (and for a wrong acceptance rule to show)."""
    return make_tiny_model(tmp_path_factory.mktemp("small-vocab"), default_model_dir, vocab_size=16)


def sampled_pairs(s, prompt: list[int], n: int) -> Counter:
    """The second and third tokens of `n` samples (the first comes from the prefill; the
    others from one speculative round)."""
    reqs = run(s, [prompt] * n, max_new_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    return Counter(tuple(r.output_ids[1:]) for r in reqs)


def test_sampled_output_follows_plain_sampling_and_a_control_without_verification_fails(
    small_vocab_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_heads_sampling(
        small_vocab_model_dir, tmp_path, monkeypatch, medusa, speculative_fixed_tree=True
    )


def check_heads_sampling(model: str, tmp_path: Path, monkeypatch, make, **options) -> None:
    """`make(model, heads, **options)` with two random heads samples as plain decoding does
    (`check_sampling_and_control`), its trees up to 10 nodes of top-3 drafts."""
    heads = random_heads(model, tmp_path / "heads", num_heads=2, seed=3)
    prompt = [5, 9, 3, 12, 7, 4]
    plain = sampled_pairs(make_spec_scheduler(model, max_running_requests=64), prompt, 300)
    options = dict(
        speculative_eagle_topk=3,
        speculative_num_steps=2,
        speculative_num_draft_tokens=10,
        speculative_max_batch_size=64,
        max_running_requests=64,
        **options,
    )
    check_sampling_and_control(
        monkeypatch,
        plain,
        functools.partial(make, model, heads, **options),
        lambda s: sampled_pairs(s, prompt, 300),
        accepted=0.3,
    )


class PublishedResBlock(torch.nn.Module):
    """The published Medusa-1 residual block, written independently of spectral's."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(self.linear(x))


def published_heads(num_heads: int, num_layers: int, hidden: int, vocab: int) -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.ModuleList(
        torch.nn.Sequential(
            *[PublishedResBlock(hidden) for _ in range(num_layers)],
            torch.nn.Linear(hidden, vocab, bias=False),
        )
        for _ in range(num_heads)
    )


@pytest.mark.parametrize("prefix", ["", "medusa_head."])
def test_heads_in_the_published_layout_load_and_compute_the_same(tmp_path: Path, prefix: str):
    reference = published_heads(3, 2, 24, 40)
    state = {prefix + k: v.contiguous() for k, v in reference.state_dict().items()}
    save_file(state, str(tmp_path / WEIGHTS_FILE))
    (tmp_path / "config.json").write_text(
        json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": "x"})
    )
    heads = load_medusa_heads(tmp_path, 24, 48)
    x = torch.randn(5, 24)
    with torch.no_grad():
        got = heads(x)
        assert len(got) == 3 and len(heads(x, 2)) == 2
        for head, out in zip(reference, got):
            assert torch.allclose(out, head(x), atol=1e-6)

    # and back: what spectral writes is that layout, key for key
    save_medusa_heads(heads, tmp_path / "again", base_model="x")
    written = load_file(str(tmp_path / "again" / WEIGHTS_FILE))
    assert written.keys() == reference.state_dict().keys()
    assert all(torch.equal(written[k], v) for k, v in reference.state_dict().items())
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2


def test_bad_head_directories_are_refused_with_a_message(tmp_path: Path, peaky_model_dir: str):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "medusa_lm_head.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="not a Medusa head directory.*pickled"):
        load_medusa_heads(tmp_path / "empty", 24, 48)
    save_medusa_heads(MedusaHeads(2, 1, 24, 40), tmp_path / "small")
    with pytest.raises(
        ValueError, match="hidden size 24 and 40 tokens; the target has hidden size 32"
    ):
        load_medusa_heads(tmp_path / "small", 32, 48)
    heads = random_heads(peaky_model_dir, tmp_path / "two", num_heads=2)
    with pytest.raises(ValueError, match="num-steps 3 exceeds the 2 Medusa heads"):
        medusa(peaky_model_dir, heads, speculative_num_steps=3)


def test_train_medusa_writes_heads_that_learned_the_text(tmp_path: Path, tiny_model_dir: str):
    """`spectral train-medusa` on a text that repeats: the heads it writes (the published
    layout, loaded back) predict the tokens two and three places ahead far better than the
    heads it started from (the target's LM head)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spectral.cli import main as cli_main
    from spectral.training.batching import collate
    from spectral.training.train_data import load_samples

    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 12))
    out = tmp_path / "heads"
    cli_main(
        [
            "train-medusa",
            "--model-path",
            tiny_model_dir,
            "--data",
            str(text),
            "--out",
            str(out),
            "--work-dir",
            str(tmp_path / "work"),
            "--num-heads",
            "2",
            "--max-steps",
            "40",
            "--lr",
            "0.01",
            "--device",
            "cpu",
        ]
    )
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    trained = load_medusa_heads(out, cfg.hidden_size, cfg.vocab_size)
    start = MedusaHeads(2, 1, cfg.hidden_size, cfg.vocab_size)
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    start.init_from_lm_head(target.get_output_embeddings().weight.detach())
    samples = load_samples([str(text)], AutoTokenizer.from_pretrained(tiny_model_dir), 512)
    ids, pad, _ = collate(samples)
    with torch.no_grad():
        hidden = target.model(input_ids=ids, attention_mask=pad).last_hidden_state
        before, after = scores(start, hidden, ids, pad), scores(trained, hidden, ids, pad)
    # per head: top-1 accuracy up from under 0.5 to over 0.8, cross-entropy down by half
    assert min(a for a, _ in after) > 0.8 and max(a for a, _ in before) < 0.5, (before, after)
    assert all(ce_after < 0.5 * ce_before for (_, ce_before), (_, ce_after) in zip(before, after))


def scores(heads, hidden, ids, pad) -> list[tuple[float, float]]:
    """Per head i, (top-1 accuracy, mean cross-entropy) of its logits at position t against
    token t + i + 2, over every position where that token is real (not padding): computed
    here, apart from the training code."""
    out = []
    for i, head in enumerate(heads.heads):
        shift = i + 2
        real = pad[:, shift:].bool() & pad[:, :-shift].bool()
        logits = head(hidden[:, :-shift]).float()[real]
        target = ids[:, shift:][real]
        picked = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
        accuracy = (logits.argmax(-1) == target).float().mean().item()
        out.append((accuracy, -picked.mean().item()))
    return out
