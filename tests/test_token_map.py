"""Hot-token maps (--speculative-token-map): the files SGLang and `spectral token-map` write
load as sorted distinct ids and anything else gets an error naming what is wrong; a map built
from text keeps its tokens by frequency, then the lowest ids, and the special tokens; a head
restricted to some rows of the default model's GGUF blocks (exact and integer path) gives
exactly those columns of the full head's logits."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from spectral.args import ServerArgs
from spectral.cli import main as cli_main
from spectral.kernels.cpu_kernels import load_cpu_kernels
from spectral.models.config import ModelConfig
from spectral.models.gguf_native import load_gguf_model
from spectral.models.loader import build_model
from spectral.models.resolve import default_model_file, model_files_dir
from spectral.speculative.drafters.token_map import build_token_map, load_token_map


def test_sglangs_tensor_files_and_json_lists_load_as_sorted_distinct_ids(tmp_path: Path):
    torch.save(torch.tensor([7, 3, 3, 900]), tmp_path / "map.pt")
    (tmp_path / "map.json").write_text("[5, 1, 5]")
    assert load_token_map(tmp_path / "map.pt", 1000).tolist() == [3, 7, 900]
    assert load_token_map(tmp_path / "map.json", 1000).tolist() == [1, 5]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("range.json", "[1, 1000]", r"must lie in \[0, 1000\) \(got 1 .. 1000\)"),
        ("negative.json", "[-1, 4]", r"must lie in \[0, 1000\)"),
        ("floats.json", "[1.5, 2.0]", "integer token ids"),
        ("empty.json", "[]", "non-empty list"),
        ("nested.json", "[[1, 2]]", "shape"),
        ("broken.json", "[1, 2", "not JSON"),
        ("garbage.pt", "not a tensor", "neither a JSON list nor a tensor"),
        ("missing.json", None, "no such file"),
    ],
)
def test_a_bad_map_is_refused_saying_what_is_wrong(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        load_token_map(path, 1000)
    assert str(path) in str(err.value)


def test_a_built_map_keeps_specials_then_frequent_tokens_then_the_lowest_ids(tokenizer):
    texts = ["def spam(eggs):\n    return eggs + eggs\n", "spam spam spam lovely spam"]
    counts = Counter(t for text in texts for t in tokenizer.encode(text))
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    size = len(special) + len(counts) + 50
    ids = build_token_map(texts, tokenizer, vocab, size)
    assert ids == sorted(set(ids)) and len(ids) == size
    assert special | set(counts) <= set(ids)
    rest = sorted(set(ids) - special - set(counts))
    assert rest == sorted(set(range(vocab)) - special - set(counts))[:50]
    # too small for all of them: the specials and the most frequent survive
    top = [t for t, _ in counts.most_common() if t not in special]
    small = build_token_map(texts, tokenizer, vocab, len(special) + 2)
    assert set(small) == special | set(top[:2]) or counts[top[1]] == counts[top[2]]
    with pytest.raises(ValueError, match="size must lie in"):
        build_token_map(texts, tokenizer, vocab, vocab + 1)


def test_the_cli_writes_a_map_that_loads(tmp_path: Path, tokenizer, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("import numpy as np\nprint(np.pi)\n")
    (corpus / "skipped.bin").write_text("zebra quagga okapi")
    out = tmp_path / "map.json"
    cli_main(
        ["token-map", "--model", "default", "--size", "300", "--output", str(out), str(corpus)]
    )
    ids = load_token_map(out, len(tokenizer)).tolist()
    assert len(ids) == 300 and "wrote 300 of" in capsys.readouterr().out
    assert set(tokenizer.encode("import numpy as np\nprint(np.pi)\n")) <= set(ids)
    assert not set(tokenizer.encode(" quagga okapi")) <= set(ids)


def test_only_a_draft_model_takes_a_token_map(tmp_path: Path):
    with pytest.raises(ValueError, match="goes with --speculative-algorithm STANDALONE"):
        ServerArgs(
            model_path="default", speculative_algorithm="EAGLE3", speculative_token_map="m.pt"
        )


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_a_restricted_gguf_head_gives_exactly_its_columns_of_the_full_logits(int8: bool):
    kernels = load_cpu_kernels()
    config = ModelConfig.from_pretrained(model_files_dir("default"))
    model = build_model(config, torch.float32)
    load_gguf_model(default_model_file(), model, config, kernels, int8=int8)
    model.set_cpu_kernels(kernels)
    assert model.logits_head.pack_rows is not None  # served from the GGUF's blocks
    hidden = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    full = model.compute_logits(hidden)
    ids = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(1))[:777]
    ids = ids.sort().values
    model.restrict_logits(ids)
    assert model.compute_logits(hidden).shape == (5, 777)
    assert torch.equal(model.compute_logits(hidden), full[:, ids])
