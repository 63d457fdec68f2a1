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
