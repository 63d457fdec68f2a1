"""Incremental detokenization against the tokenizer's full decode (the oracle)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.sampling_params import SamplingParams
from spectral.server.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Héllo wörld — naïve café 🍵 and 日本語のテキスト, done.",
    "def f(x):\n    return x ** 2  # 😀😀\n",
    "Emoji at the end 👩‍👩‍👧",
]


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_full_decode_and_never_break_characters(tokenizer, text, chunk):
    ids = tokenizer(text)["input_ids"]
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, chunk)
    full = tokenizer.decode(ids, skip_special_tokens=True)  # the detokenizer's default
    assert "".join(deltas) == full
    if "\ufffd" not in full:  # (characters the tokenizer cannot encode decode to U+FFFD)
        assert all("\ufffd" not in d for d in deltas)
    assert all("\ufffd" not in d for d in deltas)


def test_a_multibyte_character_split_over_tokens_waits_until_complete(tokenizer):
    ids = tokenizer("🍵")["input_ids"]
    assert len(ids) > 1, "the emoji should take several byte tokens"
    detok = IncrementalDetokenizer(tokenizer)
    partial = [detok.push([t]) for t in ids[:-1]]
    assert partial == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🍵"


def test_a_stop_string_spanning_tokens_is_found_and_trimmed(tokenizer):
    text = "The answer is 42. END OF ANSWER and more text"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["END OF ANSWER"]))
    out = "".join(stream(detok, ids))
    assert detok.stopped == "END OF ANSWER"
    assert out == "The answer is 42. "


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    ids = tokenizer("abc STOP def")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["STOP"], no_stop_trim=True))
    assert "".join(stream(detok, ids)) == "abc STOP"


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_a_stop_regex_match_ends_the_text_like_a_stop_string(tokenizer, no_stop_trim):
    text = "Order 66 was given in 19 BBY, then nothing"
    ids = tokenizer(text)["input_ids"]
    params = SamplingParams(stop_regex=[r"[0-9]+ BBY", "nothing"], no_stop_trim=no_stop_trim)
    detok = IncrementalDetokenizer(tokenizer, params)
    out = "".join(stream(detok, ids))
    assert detok.stopped == "19 BBY"  # the earliest match of either pattern
    assert out == ("Order 66 was given in 19 BBY" if no_stop_trim else "Order 66 was given in ")


def test_a_possible_stop_prefix_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["<end>"]))
    shown = detok.push(tokenizer("Hello <e")["input_ids"])
    assert shown == "Hello "  # "<e" could still become "<end>"
    rest = detok.push(tokenizer("xtra", add_special_tokens=False)["input_ids"])
    assert rest.startswith("<e") and detok.stopped is None


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=40), st.integers(1, 4))
def test_any_text_streams_back_exactly(tokenizer, text, chunk):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, chunk)
    full = tokenizer.decode(ids, skip_special_tokens=True)  # the detokenizer's default
    assert "".join(deltas) == full
    if "\ufffd" not in full:  # (characters the tokenizer cannot encode decode to U+FFFD)
        assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.one_of(st.integers(0, 20), st.integers(0, 49151)), min_size=1, max_size=24),
    skip=st.booleans(),
)
def test_the_tokenizer_json_decoder_decodes_as_transformers(default_decoder, tokenizer, ids, skip):
    """The detokenizer process's decoder (tokenizer.json alone, no transformers): the same text
    as transformers' tokenizer for any ids, special ones (ids 0-16 here) included, whether
    special tokens are skipped or not."""
    want = tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=False)
    assert default_decoder.decode(ids, skip_special_tokens=skip) == want


@pytest.fixture(scope="module")
def default_decoder(default_model_dir):
    from spectral.server.detokenizer import TokenizerJsonDecoder, load_decoder

    decoder = load_decoder(default_model_dir)
    assert isinstance(decoder, TokenizerJsonDecoder)
    return decoder


@pytest.mark.parametrize("change", ["clean_up", "special_elsewhere"])
def test_a_tokenizer_json_that_would_decode_otherwise_falls_back_to_transformers(
    default_model_dir, tmp_path, change
):
    import json
    import shutil

    from spectral.server.detokenizer import TokenizerJsonDecoder, load_decoder

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_model_dir}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if change == "clean_up":
        config["clean_up_tokenization_spaces"] = True
    else:  # a token only tokenizer_config.json calls special
        config.setdefault("added_tokens_decoder", {})["300"] = {"content": "x", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    decoder = load_decoder(str(tmp_path))
    assert not isinstance(decoder, TokenizerJsonDecoder)
    assert decoder.decode([28, 29]) == load_decoder(default_model_dir).decode([28, 29])
