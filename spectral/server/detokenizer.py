"""Incremental detokenization: text deltas that never split a UTF-8 character, and stop
strings found even when they span several tokens.

`IncrementalDetokenizer` keeps one request's state; each `push(new_ids)` returns the text safe
to show now, holding back an incomplete character and any tail that could still become a stop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from spectral.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Tokens decoded before the new ones, so that tokenizers which drop a leading space when
# decoding a lone token (sentencepiece) still produce the right delta.
CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True, **kwargs: bool) -> str: ...


class TokenizerJsonDecoder:
    """Decoding as transformers' fast tokenizers do it (the `tokenizers` model's own decode,
    with `spaces_between_special_tokens` ignored and no clean-up), read from tokenizer.json
    alone: the detokenizer process then starts without importing transformers and torch."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend  # a tokenizers.Tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: bool) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(tokenizer_dir: str) -> Tokenizer:
    """What the detokenizer decodes with: a `TokenizerJsonDecoder` where the directory's
    tokenizer.json decodes as transformers would (no clean-up of spaces configured, and every
    token tokenizer_config.json calls special is special there too), else transformers'
    tokenizer."""
    directory = Path(tokenizer_dir)
    backend_file, config_file = directory / "tokenizer.json", directory / "tokenizer_config.json"
    if backend_file.is_file() and config_file.is_file():
        from tokenizers import Tokenizer as RustTokenizer

        backend = RustTokenizer.from_file(str(backend_file))
        config = json.loads(config_file.read_text())
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        wanted = {
            int(i) for i, t in config.get("added_tokens_decoder", {}).items() if t.get("special")
        }
        if not config.get("clean_up_tokenization_spaces") and wanted <= special:
            return TokenizerJsonDecoder(backend)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


class IncrementalDetokenizer:
    """One request's detokenizer. It waits while the decoded tail is an incomplete character
    (the tokenizer shows U+FFFD) and holds back text that could still become a stop string or
    a stop regex's match; once one appears the text is cut before it (unless `no_stop_trim`)
    and `stopped` is set."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        self.tokenizer = tokenizer
        self.params = params
        self.stop = [s for s in params.stop if s]
        self.no_stop_trim = params.no_stop_trim
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context tokens
        self.read_offset = 0  # tokens before this are in `text`
        self.text = ""  # everything decoded so far (cut at a stop string once found)
        self.sent = 0  # characters of `text` already handed out
        self.stopped: str | None = None  # the stop string that ended the text
        # Where a stop regex's match may be starting in `text` (a partial match), if anywhere.
        self.regex_pending: int | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.params.decode(self.tokenizer, ids)

    def push(self, new_ids: list[int]) -> str:
        """Append tokens; return the text newly safe to emit (possibly empty)."""
        if self.stopped is not None:
            return ""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT_CHAR):
            self.text += after[len(before) :]
            self.prefix_offset = max(self.read_offset, len(self.ids) - CONTEXT_TOKENS)
            self.read_offset = len(self.ids)
            self._find_stop(len(self.text) - (len(after) - len(before)))
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: return everything not yet emitted (complete or not)."""
        if self.stopped is None and self.read_offset < len(self.ids):
            before = self._decode(self.ids[self.prefix_offset : self.read_offset])
            after = self._decode(self.ids[self.prefix_offset :])
            self.text += after[len(before) :]
            self.read_offset = len(self.ids)
            self._find_stop(0)
        return self._release(final=True)

    def _find_stop(self, new_from: int) -> None:
        hits = []
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(0, new_from - longest + 1)
            found = [(self.text.find(s, start), s) for s in self.stop]
            hits = [(i, i + len(s), s) for i, s in found if i >= 0]
        if self.params.stop_regex:
            # One search finds a whole match (the text stops) or a partial one at the end
            # (held back by _holdback).
            match = self.params.search_stop_regex(self.text, partial=True)
            self.regex_pending = match.start() if match is not None and match.partial else None
            if match is not None and not match.partial:
                hits.append((match.start(), match.end(), match.group()))
        if hits:
            start, end, stop = min(hits)
            self.stopped = stop
            self.text = self.text[: end if self.no_stop_trim else start]

    def _holdback(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string or
        where a stop regex's match may be starting."""
        best = 0 if self.regex_pending is None else len(self.text) - self.regex_pending
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stopped is None:
            end -= self._holdback()
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out
