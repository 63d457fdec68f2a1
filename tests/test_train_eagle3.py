"""Training EAGLE-3 heads on a tiny random target: the loss falls, export → load gives the same
draft logits, and a rerun resumes from the checkpoint."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from spectral.models.config import ModelConfig
from spectral.speculative.drafters.eagle_head import load_draft_head
from spectral.training.batching import collate
from spectral.training.config import TrainConfig, resolve_device
from spectral.training.draft_vocab import draft_vocabulary, remap_output_rows
from spectral.training.evaluate import chain_accept_length, evaluate
from spectral.training.head import export, new_head
from spectral.training.teacher import Teacher, TeacherCache
from spectral.training.train import train
from spectral.training.train_data import (
    Sample,
    generate_answers,
    generate_second_turns,
    load_samples,
    sharegpt_first_turns,
    training_files,
    without_prompts_of,
)
from spectral.training.ttt import ttt_loss
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-8-layers"),
        default_model_dir,
        num_hidden_layers=8,
        initializer_range=1.0,
    )


def random_samples(n: int, length: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 300) for _ in range(length)]
        prompt = length // 3
        out.append(Sample(ids, [0] * prompt + [1] * (length - prompt)))
    return out


def write_answers(path: Path, samples: list[Sample], prompt_len: int) -> str:
    """`samples` as generated-answer JSONL (the first `prompt_len` tokens are the prompt)."""
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": str(i),
                    "input_ids": s.input_ids[:prompt_len],
                    "output_ids": s.input_ids[prompt_len:],
                }
            )
            + "\n"
            for i, s in enumerate(samples)
        )
    )
    return str(path)


def tiny_run(target_dir: str, data: str, work_dir: Path, **overrides) -> TrainConfig:
    """A few-step run on the tiny target (two unrolled steps, 128-token draft vocabulary)."""
    options = {"draft_vocab_size": 128, "ttt_steps": 2, "max_len": 64, **overrides}
    return TrainConfig(model_path=target_dir, data=[data], work_dir=str(work_dir), **options)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, atol: float = 0.0) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(p, q, atol=atol, rtol=0), name


def load_export(path: str, target_dir: str):
    """An exported head, loaded in float32 as serving loads it for the tiny target."""
    config = ModelConfig.from_pretrained(target_dir)
    return load_draft_head(
        path,
        "eagle3",
        config.hidden_size,
        config.vocab_size,
        config.num_layers,
        max_positions=64,
        dtype=torch.float32,
    )


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over one sequence ([T, heads, dim] in, [T, heads * dim] out)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5
    future = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v).reshape(q.shape[0], -1)


def draft_logits(head, ids: torch.Tensor, features: torch.Tensor) -> list[torch.Tensor]:
    """The head's draft logits over each row of a batch, run on its own, causally."""
    positions = torch.arange(ids.shape[1])
    with torch.no_grad():
        return [head.logits(head(i, f, positions, causal)) for i, f in zip(ids, features)]


def setup_head(target_dir: str, samples: list[Sample], cfg: TrainConfig):
    config = ModelConfig.from_pretrained(target_dir)
    head = new_head(config, cfg)
    d2t, t2d = draft_vocabulary(samples, cfg.draft_vocab_size, config.vocab_size)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    teacher = Teacher(target_dir, head.cfg.aux_layers, torch.float32)
    head.set_target(teacher.embed_weight.detach(), None)
    return head, teacher


def test_loss_falls_on_a_fixed_batch(target_dir: str) -> None:
    torch.manual_seed(0)
    cfg = TrainConfig(draft_vocab_size=256, ttt_steps=3, max_len=64)
    samples = random_samples(4, 48)
    head, teacher = setup_head(target_dir, samples, cfg)
    assert head.cfg.aux_layers == (2, 4, 5)
    ids, pad, mask = collate(samples)
    used = torch.arange(cfg.draft_vocab_size) + head.d2t
    features, logits = TeacherCache(teacher, None)(samples, ids, pad, used)
    params = list(head.parameters())
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(40):
        loss, accs, counts = ttt_loss(head, ids, pad, mask, features, logits, cfg.ttt_steps)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert len(accs) == 3 and all(c > 0 for c in counts)
    assert losses[-1] < 0.5 * losses[0]


def test_export_then_load_gives_identical_draft_logits(tmp_path: Path, target_dir: str) -> None:
    cfg = TrainConfig(draft_vocab_size=256, max_len=64)
    samples = random_samples(2, 32)
    head, teacher = setup_head(target_dir, samples, cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # norms away from their initial ones
    export(head, str(tmp_path / "head"), torch.float32)
    loaded = load_export(str(tmp_path / "head"), target_dir)
    loaded.set_target(teacher.embed_weight.detach(), None)
    assert loaded.cfg.aux_layers == head.cfg.aux_layers
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    ids, pad, mask = collate(samples)
    used = torch.arange(256) + head.d2t
    features, _ = TeacherCache(teacher, None)(samples, ids, pad, used)
    for a, b in zip(draft_logits(head, ids, features), draft_logits(loaded, ids, features)):
        assert torch.equal(a, b)


def test_a_rerun_resumes_from_the_checkpoint(tmp_path: Path, target_dir: str) -> None:
    data = write_answers(tmp_path / "data.jsonl", random_samples(2, 40), 10)
    common = dict(warmup_steps=2, save_every=1)
    train(tiny_run(target_dir, data, tmp_path / "a", max_steps=3, **common))
    assert torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["step"] == 3
    resumed = train(tiny_run(target_dir, data, tmp_path / "a", max_steps=5, **common))
    straight = train(tiny_run(target_dir, data, tmp_path / "b", max_steps=5, **common))
    assert torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["step"] == 5
    assert_same_weights(resumed, straight, atol=1e-6)


def test_cached_teacher_states_train_exactly_like_recomputed_ones(
    tmp_path: Path, target_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = random_samples(6, 24, seed=2) + random_samples(4, 40, seed=3)
    data = write_answers(tmp_path / "data.jsonl", samples, 8)
    # 96-token batches: 4 batches an epoch, so 9 steps run 2 epochs on cached states.
    common = dict(batch_tokens=96, max_steps=9)
    fresh = train(tiny_run(target_dir, data, tmp_path / "a", cache_teacher="off", **common))
    for kind in ("memory", "disk"):
        cached = train(tiny_run(target_dir, data, tmp_path / kind, cache_teacher=kind, **common))
        assert_same_weights(cached, fresh)
    # A later run over the same data reads every state from disk: the target never runs.
    (tmp_path / "disk" / "checkpoint.pt").unlink()

    def no_target(*args: object) -> None:
        raise AssertionError("the target ran although its states were on disk")

    monkeypatch.setattr(Teacher, "states", no_target)
    again = train(tiny_run(target_dir, data, tmp_path / "disk", cache_teacher="disk", **common))
    assert_same_weights(again, fresh)


def test_init_from_an_export_starts_from_its_weights_and_vocabulary(
    tmp_path: Path, target_dir: str
) -> None:
    data = write_answers(tmp_path / "data.jsonl", random_samples(2, 40, seed=1), 10)
    head = str(tmp_path / "head")
    trained = train(
        tiny_run(target_dir, data, tmp_path / "a", out=head, export_dtype="float32", max_steps=2)
    )
    # Zero steps from the export: the head is the export, d2t/t2d included.
    started = train(tiny_run(target_dir, data, tmp_path / "b", init_from=head, max_steps=0))
    assert_same_weights(trained, started)
    with pytest.raises(SystemExit, match="draft-vocab-size"):
        train(
            tiny_run(
                target_dir, data, tmp_path / "c", init_from=head, max_steps=0, draft_vocab_size=64
            )
        )


def test_init_from_a_narrower_head_widens_it_without_changing_its_logits(
    tmp_path: Path, target_dir: str
) -> None:
    samples = random_samples(2, 40, seed=1)
    data = write_answers(tmp_path / "data.jsonl", samples, 10)
    head = str(tmp_path / "head")
    run = tiny_run(target_dir, data, tmp_path / "a", out=head, export_dtype="float32", max_steps=2)
    narrow = train(run)
    width = narrow.cfg.intermediate_size
    wide = train(
        tiny_run(
            target_dir,
            data,
            tmp_path / "b",
            init_from=head,
            max_steps=0,
            intermediate_size=3 * width,
        )
    )
    assert wide.layer.mlp.down_proj.weight.shape[1] == 3 * width
    teacher = Teacher(target_dir, narrow.cfg.aux_layers, torch.float32)
    ids, pad, _ = collate(samples)
    used = torch.arange(run.draft_vocab_size) + narrow.d2t
    features, _ = TeacherCache(teacher, None)(samples, ids, pad, used)
    for h in (narrow, wide):
        h.set_target(teacher.embed_weight.detach(), None)
    for a, b in zip(draft_logits(narrow, ids, features), draft_logits(wide, ids, features)):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    with pytest.raises(SystemExit, match="intermediate_size"):
        train(
            tiny_run(
                target_dir, data, tmp_path / "c", init_from=head, max_steps=0, intermediate_size=8
            )
        )


def test_held_out_agreement_counts_first_step_hits_like_a_direct_forward(target_dir: str) -> None:
    """evaluate()'s first-step agreement, recounted with the target from transformers and the
    head run causally over each sample: anchor t (feature t, token t + 1) against the target's
    choice over its whole vocabulary at t + 1, wherever token t + 2 is an answer token. The
    draft vocabulary holds only some of the target's choices: those it lacks are misses,
    although the head agrees with the teacher's top draft token there."""
    torch.manual_seed(1)
    cfg = TrainConfig(draft_vocab_size=256, max_len=64)
    samples = random_samples(3, 30, seed=4) + random_samples(2, 22, seed=5)
    config = ModelConfig.from_pretrained(target_dir)
    head = new_head(config, cfg)
    teacher = Teacher(target_dir, head.cfg.aux_layers, torch.float32)
    head.set_target(teacher.embed_weight.detach(), None)
    with torch.no_grad():
        choices = [
            teacher.model(input_ids=torch.tensor([s.input_ids])).logits[0].argmax(-1)
            for s in samples
        ]
    common = Counter(int(t) for c in choices for t in c).most_common()
    kept = [t for t, _ in common[: len(common) // 2]]
    fill = [t for t in range(config.vocab_size) if t not in {t for t, _ in common}]
    used = torch.tensor(sorted(kept + fill[: 256 - len(kept)]))
    head.d2t.copy_(used - torch.arange(256))
    head.t2d.zero_()
    head.t2d[used] = True
    # Fit the head to these samples a little, so that it agrees with the target often.
    ids, pad, mask = collate(samples)
    features, logits = TeacherCache(teacher, None)(samples, ids, pad, used)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(30):
        loss, _, _ = ttt_loss(head, ids, pad, mask, features, logits, 3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    accs = evaluate(head, TeacherCache(teacher, None), samples, used, steps=3, batch_tokens=64)
    assert len(accs) == 3
    hits = total = unreachable = 0
    with torch.no_grad():
        for s, target_choice in zip(samples, choices):
            row = torch.tensor([s.input_ids])
            out = teacher.model(input_ids=row, output_hidden_states=True)
            states = torch.cat([out.hidden_states[i] for i in head.cfg.aux_layers], -1)[0]
            T = row.shape[1]
            hidden = head(row[0, 1:], states[: T - 1], torch.arange(T - 1), causal)
            draft_choice = used[head.logits(hidden).argmax(-1)]  # at anchor t: token t + 2
            for t in range(T - 2):
                if s.loss_mask[t + 2]:
                    hits += int(draft_choice[t] == target_choice[t + 1])
                    unreachable += int(target_choice[t + 1] not in kept)
                    total += 1
    assert hits > 0 and unreachable > 0
    assert accs[0] == pytest.approx(hits / total, abs=1e-9)
    with torch.no_grad():
        _, in_vocab, _ = ttt_loss(head, ids, pad, mask, features, logits, 3)
    assert in_vocab[0] > accs[0]  # agreement within the draft vocabulary overstates it
    assert chain_accept_length(accs) == pytest.approx(
        1 + accs[0] + accs[0] * accs[1] + accs[0] * accs[1] * accs[2]
    )


def test_evaluating_held_out_data_leaves_training_unchanged(
    tmp_path: Path, target_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    data = write_answers(tmp_path / "data.jsonl", random_samples(3, 40, seed=6), 10)
    held = write_answers(tmp_path / "held.jsonl", random_samples(2, 30, seed=7), 10)
    common = dict(max_steps=4, save_every=2)
    with caplog.at_level("INFO", logger="spectral.training.train"):
        scored = train(tiny_run(target_dir, data, tmp_path / "a", eval_data=[held], **common))
    plain = train(tiny_run(target_dir, data, tmp_path / "b", **common))
    assert_same_weights(scored, plain)
    lines = [r.getMessage() for r in caplog.records if "held out" in r.getMessage()]
    assert [line.split(",")[0] for line in lines] == ["step 2", "step 4"]


def test_remapped_output_rows_keep_known_tokens_and_fit_new_ones() -> None:
    """A head whose rows are a linear map of the target's (plus a little noise): known tokens
    keep their rows exactly, new tokens get the map's image of the target's rows."""
    torch.manual_seed(0)
    target_out = torch.randn(500, 16)
    true_map = torch.randn(16, 12)
    old = torch.randperm(500)[:200].sort().values
    rows = target_out[old] @ true_map + 0.01 * torch.randn(200, 12)
    new = torch.cat((old[:50], torch.tensor([t for t in range(500) if t not in old][:70])))
    new = new.sort().values
    out = remap_output_rows(rows, old, new, target_out)
    assert out.shape == (120, 12)
    where = {int(t): i for i, t in enumerate(old)}
    for j, t in enumerate(new.tolist()):
        if t in where:
            assert torch.equal(out[j], rows[where[t]])
        else:
            assert torch.allclose(out[j], target_out[t] @ true_map, atol=0.05)


def test_init_from_with_rebuild_vocab_moves_the_head_to_this_runs_vocabulary(
    tmp_path: Path, target_dir: str
) -> None:
    first = random_samples(3, 40, seed=1)
    second = random_samples(3, 40, seed=2)
    head = str(tmp_path / "head")
    trained = train(
        tiny_run(
            target_dir,
            write_answers(tmp_path / "first.jsonl", first, 10),
            tmp_path / "a",
            out=head,
            export_dtype="float32",
            max_steps=2,
        )
    )
    data = write_answers(tmp_path / "second.jsonl", second, 10)
    moved = train(
        tiny_run(
            target_dir,
            data,
            tmp_path / "b",
            init_from=head,
            rebuild_vocab=True,
            draft_vocab_size=96,
            max_steps=0,
        )
    )
    config = ModelConfig.from_pretrained(target_dir)
    loaded = load_samples([data], None, 64)
    d2t, t2d = draft_vocabulary(loaded, 96, config.vocab_size)
    assert torch.equal(moved.d2t, d2t) and torch.equal(moved.t2d, t2d)
    old_ids = (torch.arange(128) + trained.d2t).tolist()
    new_ids = (torch.arange(96) + moved.d2t).tolist()
    shared = set(old_ids) & set(new_ids)
    assert 0 < len(shared) < 96
    for t in shared:
        assert torch.equal(
            moved.lm_head.weight[new_ids.index(t)], trained.lm_head.weight[old_ids.index(t)]
        )
    for (name, a), b in zip(trained.state_dict().items(), moved.state_dict().values()):
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(a, b), name
    with pytest.raises(SystemExit, match="rebuild-vocab"):
        train(tiny_run(target_dir, data, tmp_path / "c", rebuild_vocab=True, max_steps=0))


def test_device_names_resolve_or_are_refused_with_what_is_allowed() -> None:
    gpu = torch.cuda.is_available()
    assert resolve_device("auto") == torch.device("cuda" if gpu else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(SystemExit, match="auto, cpu, cuda"):
        resolve_device("gpu0")
    if not gpu:
        with pytest.raises(SystemExit, match="sees no GPU"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_run_trains_like_a_cpu_run_and_exports_the_same_layout(
    tmp_path: Path, target_dir: str
) -> None:
    """The same steps on the GPU and on the CPU (both autocast to bfloat16) move the weights
    the same way (AdamW's early updates follow the gradients' signs, so a wrong gradient on
    either device turns them apart); the GPU run's checkpoint resumes and its export loads on
    the CPU."""
    data = write_answers(tmp_path / "data.jsonl", random_samples(3, 40, seed=8), 10)
    held = write_answers(tmp_path / "held.jsonl", random_samples(2, 30, seed=9), 10)
    common = dict(save_every=2, eval_data=[held], export_dtype="float32")
    start = train(tiny_run(target_dir, data, tmp_path / "z", device="cpu", max_steps=0))
    on_cpu = train(tiny_run(target_dir, data, tmp_path / "a", device="cpu", max_steps=3, **common))
    out = str(tmp_path / "head")
    on_gpu = train(
        tiny_run(target_dir, data, tmp_path / "b", device="cuda", max_steps=3, out=out, **common)
    )
    assert on_gpu.fc.weight.device.type == "cuda"
    before, after_cpu, after_gpu = (h.state_dict() for h in (start, on_cpu, on_gpu))
    for name, p in before.items():
        if p.is_floating_point() and not torch.equal(after_cpu[name], p):
            moved_cpu = (after_cpu[name] - p).flatten()
            moved_gpu = (after_gpu[name].cpu() - p).flatten()
            assert F.cosine_similarity(moved_cpu, moved_gpu, dim=0) > 0.95, name
    resumed = train(tiny_run(target_dir, data, tmp_path / "b", device="cuda", max_steps=4))
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["step"] == 4
    loaded = load_export(out, target_dir)
    assert torch.equal(loaded.d2t, resumed.d2t.cpu())


def test_sharegpt_first_turns_skip_the_first_prompts_and_stop_at_the_cut(tmp_path: Path) -> None:
    entries = [
        {"id": "a", "conversations": [{"from": "human", "value": "one"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "not a user turn"}]},
        {"id": "c", "conversations": [{"from": "human", "value": " two "}]},
        {"id": "d", "conversations": [{"from": "human", "value": "three"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "four"}]},
    ]
    text = json.dumps(entries)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rindex('{"id": "e"') + 12])  # the last entry is cut off
    assert list(sharegpt_first_turns(10, str(path))) == [("a", "one"), ("c", "two"), ("d", "three")]
    assert list(sharegpt_first_turns(1, str(path), skip=1)) == [("c", "two")]
    assert list(sharegpt_first_turns(5, str(path), skip=2)) == [("d", "three")]


def test_training_leaves_out_other_answers_to_held_out_prompts() -> None:
    def chat(prompt: list[int], answer: list[int]) -> Sample:
        return Sample(prompt + answer, [0] * len(prompt) + [1] * len(answer))

    held_out = [chat([1, 2, 3], [9, 9]), Sample([5, 6], [1, 1])]
    samples = [
        chat([1, 2, 3], [7, 8, 4]),  # another answer to a held-out prompt: out
        chat([1, 2], [3, 9, 9]),  # a prompt that is a prefix of one held out: kept
        chat([1, 2, 3, 4], [9]),  # one that extends it: kept
        Sample([5, 6], [1, 1]),  # plain text has no prompt: kept
    ]
    assert without_prompts_of(samples, held_out) == samples[1:]
    assert without_prompts_of(samples, []) == samples


class EchoEngine:
    """An Engine stand-in that answers every prompt with its last three tokens and keeps the
    sampling parameters it was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.asked: list[list[int]] = []
        self.params: list[dict] = []
        self.shut_down = False

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict]) -> list[dict]:
        assert len(sampling_params) == len(input_ids)
        self.asked.extend(input_ids)
        self.params.extend(sampling_params)
        return [{"output_ids": ids[-3:]} for ids in input_ids]

    def shutdown(self) -> None:
        self.shut_down = True


def _sharegpt_file(tmp_path: Path) -> Path:
    """Five conversations: a and e have a real second user turn, b none, c a blank one, d one
    whose first turn the tests never answer."""

    def turns(*values: str) -> list[dict]:
        return [{"from": ("human", "gpt")[i % 2], "value": v} for i, v in enumerate(values)]

    entries = [
        {"id": "a", "conversations": turns("one", "written answer", "and then?")},
        {"id": "b", "conversations": turns("two")},
        {"id": "c", "conversations": turns("three", "x", "   ")},
        {"id": "d", "conversations": turns("four", "y", "not answered first")},
        {"id": "e", "conversations": turns("five", "z", "why?")},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path


def _chat(tokenizer, *messages: str) -> list[int]:
    roles = ("user", "assistant")
    return tokenizer.apply_chat_template(
        [{"role": roles[i % 2], "content": m} for i, m in enumerate(messages)],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _first_answers(tokenizer, path: Path, ids: str) -> None:
    """First answers as if the target had said "Sure, here:" to each conversation in `ids`."""
    answer = tokenizer("Sure, here:")["input_ids"] + [tokenizer.eos_token_id]
    path.write_text(
        "".join(
            json.dumps({"id": rid, "input_ids": _chat(tokenizer, "?"), "output_ids": answer}) + "\n"
            for rid in ids
        )
    )


def test_second_turns_are_asked_after_the_targets_own_first_answer(
    tmp_path: Path, default_model_dir: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    sharegpt = _sharegpt_file(tmp_path)
    engine = EchoEngine(tokenizer)

    first = tmp_path / "first.jsonl"
    generate_answers(engine, str(first), 3, 8, sharegpt_path=str(sharegpt))
    assert [(r["id"], r["input_ids"]) for r in _rows(first)] == [
        ("a", _chat(tokenizer, "one")),
        ("b", _chat(tokenizer, "two")),
        ("c", _chat(tokenizer, "three")),
    ]
    assert {p["temperature"] for p in engine.params} == {0.0}  # greedy unless asked
    _first_answers(tokenizer, first, "abce")
    second = tmp_path / "second.jsonl"
    generate_second_turns(engine, [str(first)], str(second), 8, sharegpt_path=str(sharegpt))
    got = _rows(second)
    assert [r["id"] for r in got] == ["a/2", "e/2"]
    assert got[0]["input_ids"] == _chat(tokenizer, "one", "Sure, here:", "and then?")
    assert got[1]["input_ids"] == _chat(tokenizer, "five", "Sure, here:", "why?")
    assert all(r["output_ids"] == r["input_ids"][-3:] for r in got)

    asked = len(engine.asked)
    generate_second_turns(engine, [str(first)], str(second), 8, sharegpt_path=str(sharegpt))
    assert len(engine.asked) == asked and _rows(second) == got  # a rerun answers nothing twice
    limited = tmp_path / "limited.jsonl"
    generate_second_turns(
        engine, [str(first)], str(limited), 8, limit=1, sharegpt_path=str(sharegpt)
    )
    assert [r["id"] for r in _rows(limited)] == ["a/2"]


def test_sampled_answers_draw_at_the_temperature_with_a_seed_from_each_id(
    tmp_path: Path, default_model_dir: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    sharegpt = _sharegpt_file(tmp_path)
    seeds = []
    for run in range(2):
        engine = EchoEngine(tokenizer)
        out = tmp_path / f"sampled{run}.jsonl"
        generate_answers(engine, str(out), 3, 8, sharegpt_path=str(sharegpt), temperature=0.7)
        assert [p["temperature"] for p in engine.params] == [0.7] * 3
        assert all(p["max_new_tokens"] == 8 for p in engine.params)
        seeds.append([p["seed"] for p in engine.params])
        _first_answers(tokenizer, out, "ae")
        second = tmp_path / f"second{run}.jsonl"
        generate_second_turns(
            engine, [str(out)], str(second), 8, sharegpt_path=str(sharegpt), temperature=0.7
        )
        assert [p["temperature"] for p in engine.params[3:]] == [0.7] * 2
        seeds[-1] += [p["seed"] for p in engine.params[3:]]
    assert seeds[0] == seeds[1]  # a rerun draws the same answers
    assert len(set(seeds[0])) == 5  # each prompt its own draw


def test_a_run_on_given_files_answers_their_second_turns_only_when_asked(
    tmp_path: Path, default_model_dir: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    sharegpt = str(_sharegpt_file(tmp_path))
    first = tmp_path / "first.jsonl"
    _first_answers(tokenizer, first, "ce")
    engines: list[EchoEngine] = []

    def make_engine() -> EchoEngine:
        engines.append(EchoEngine(tokenizer))
        return engines[-1]

    work = tmp_path / "work"
    cfg = TrainConfig(work_dir=str(work), data=[str(first)], max_new_tokens=8)
    assert training_files(cfg, make_engine, sharegpt) == [str(first)]
    assert engines == []  # no generation asked for: no engine started

    cfg.second_turns = True
    second = work / "sharegpt-second-turns.jsonl"
    assert training_files(cfg, make_engine, sharegpt) == [str(first), str(second)]
    assert [r["id"] for r in _rows(second)] == ["e/2"]
    assert _rows(second)[0]["input_ids"] == _chat(tokenizer, "five", "Sure, here:", "why?")
    assert engines[0].shut_down

    # naming the second-turn file among the data lists it once and answers nothing again
    cfg.data = [str(first), str(second)]
    assert training_files(cfg, make_engine, sharegpt) == [str(first), str(second)]
    assert engines[1].asked == [] and len(_rows(second)) == 1
