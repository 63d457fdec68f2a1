"""`RuntimeEndpoint`: a spectral (or SGLang) server's native `POST /generate`, over `urllib`.

gen sends the prompt (streamed as SSE with cumulative text); the prefix hint of forks and
run_batch prefills with `max_new_tokens: 0`, which leaves the text in the radix cache; select
scores the choices by their tokens' logprobs (see `RuntimeEndpoint.select`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPResponse
from typing import Any

from spectral.lang.backends.base import Backend, BackendError, Choice, Context, Generation
from spectral.lang.chat_template import CHATML, ChatTemplate
from spectral.lang.ir import SamplingParams

# Prompt tokens before the prompt's end whose logprobs `select` asks for (token healing).
HEALING_TOKENS = 2


class RuntimeEndpoint(Backend):
    """A running server at `base_url` (e.g. "http://127.0.0.1:30000").

    Construction checks that the server answers (`GET /get_model_info`) and raises
    ConnectionError naming the URL if it does not. Roles render with `chat_template`
    (ChatML by default, see `spectral.lang.chat_template`)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        chat_template: ChatTemplate = CHATML,
        timeout: float = 600.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.chat_template = chat_template
        self.timeout = timeout
        self.model_info: dict[str, Any] = self._call("/get_model_info")

    # ---- backend interface -------------------------------------------------------------------

    def generate(self, ctx: Context, params: SamplingParams) -> Generation:
        out = self._call("/generate", self._gen_body(ctx, params))
        return Generation(out["text"], out["meta_info"])

    def generate_stream(
        self, ctx: Context, params: SamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        sent = 0
        for event in self._stream("/generate", {**self._gen_body(ctx, params), "stream": True}):
            text = event["text"]
            yield text[sent:], event["meta_info"]
            sent = len(text)

    def select(self, ctx: Context, choices: list[str], temperature: float) -> Choice:
        """The choice whose tokens have the best mean logprob (ties: the earlier one);
        `temperature` does not change scores.

        A prefill of the prompt gives its length P in tokens (and caches it); one batch of
        the prompt and prompt + each choice then returns logprobs from P - 2 on. A choice's
        tokens start where its token ids first differ from the prompt's, which catches a
        last prompt token that merges with the choice ("A: " + "True" -> "A:" + " True")."""
        if not ctx.text:
            raise ValueError(
                "select() needs some text before it: the first token of a prompt has no logprob"
            )
        prompt_len = self._call(
            "/generate", {"text": ctx.text, "sampling_params": {"max_new_tokens": 0}}
        )["meta_info"]["prompt_tokens"]
        outs = self._call(
            "/generate",
            {
                "text": [ctx.text, *(ctx.text + choice for choice in choices)],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": max(prompt_len - HEALING_TOKENS, 0),
            },
        )
        prompt_tail = [tok for _, tok, _ in outs[0]["meta_info"]["input_token_logprobs"]]
        scores, choice_logprobs = [], []
        for out in outs[1:]:
            entries = out["meta_info"]["input_token_logprobs"]
            start = _first_difference(prompt_tail, [tok for _, tok, _ in entries])
            scored = [(lp, tok) for lp, tok, _ in entries[start:] if lp is not None]
            choice_logprobs.append(scored)
            scores.append(sum(lp for lp, _ in scored) / len(scored) if scored else float("-inf"))
        best = max(range(len(choices)), key=lambda i: (scores[i], -i))
        return Choice(
            choices[best],
            {
                "normalized_prompt_logprobs": scores,
                "input_token_logprobs": choice_logprobs,
                "prompt_tokens": prompt_len,
            },
        )

    def cache_prefix(self, text: str) -> None:
        """Prefill `text` so that it sits in the server's radix cache."""
        if text:
            self._call("/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}})

    # ---- server utilities --------------------------------------------------------------------

    def get_server_info(self) -> dict[str, Any]:
        return self._call("/get_server_info")

    def flush_cache(self) -> None:
        """Empty the server's radix cache (the server refuses while requests are running)."""
        self._call("/flush_cache", {})

    # ---- HTTP --------------------------------------------------------------------------------

    def _gen_body(self, ctx: Context, params: SamplingParams) -> dict[str, Any]:
        return {"text": ctx.text, "sampling_params": params.to_native()}

    def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        with self._open(path, body) as response:
            return json.loads(response.read())

    def _stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON events of an SSE response, up to `data: [DONE]`. Closing the iterator
        early closes the connection, which makes the server abort the request."""
        with self._open(path, body) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise BackendError(f"POST {self.base_url}{path}: {_message(event)}")
                yield event

    def _open(self, path: str, body: dict[str, Any] | None) -> HTTPResponse:
        url = self.base_url + path
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as err:
            try:
                detail = _message(json.loads(err.read()))
            except ValueError:
                detail = err.reason
            hint = " (pass api_key= to RuntimeEndpoint)" if err.code == 401 else ""
            raise BackendError(
                f"{request.get_method()} {url} failed with HTTP {err.code}: {detail}{hint}"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ConnectionError(
                f"cannot reach the server at {self.base_url} ({reason}); is it running? "
                "Start one with `spectral serve` or pass the right URL to RuntimeEndpoint"
            ) from err


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where `a` and `b` differ (or the shorter one ends)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)
