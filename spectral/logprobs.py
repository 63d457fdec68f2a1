"""SGLang's logprob entries of `meta_info`, built in one place for the server and the Engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Entry = tuple[float | None, int, str | None]


def logprob_meta(
    input_logprobs: Sequence[tuple[float | None, int]],
    output_logprobs: Sequence[tuple[float, int]],
    output_top: Sequence[Sequence[tuple[float, int]] | None] | None,
    token_text: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """`input_token_logprobs` (the first has no logprob) and `output_token_logprobs`, always
    there, empty or not, as (logprob, token id, token text) with the text only where
    `token_text` is given; `output_top_logprobs` with `output_top`; and
    `normalized_prompt_logprob`, the mean of the prompt logprobs given (None without one)."""

    def entry(lp: float | None, tok: int) -> Entry:
        return (lp, tok, token_text(tok) if token_text else None)

    scored = [lp for lp, _ in input_logprobs if lp is not None]
    meta: dict[str, Any] = {
        "input_token_logprobs": [entry(lp, tok) for lp, tok in input_logprobs],
        "output_token_logprobs": [entry(lp, tok) for lp, tok in output_logprobs],
        "normalized_prompt_logprob": sum(scored) / len(scored) if scored else None,
    }
    if output_top is not None:
        meta["output_top_logprobs"] = [
            [entry(lp, tok) for lp, tok in (top or [])] for top in output_top
        ]
    return meta
