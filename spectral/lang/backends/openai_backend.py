"""`OpenAI`: any OpenAI-compatible server (spectral's `/v1` included) via the official client.

Chat models get the finished role turns as `messages`, so a `gen` or `select` must open the
assistant turn: the API continues a conversation, not a half-written reply. Completion models
(`is_chat_model=False`) get the text as `prompt`, and their `select` scores the choices by
echoed prompt logprobs where the server gives them; otherwise (always on a chat model, whose API
cannot score given text) `select` generates greedily and picks the closest choice.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Any

from spectral.lang.backends.base import Backend, BackendError, Choice, Context, Generation
from spectral.lang.chat_template import CHATML, ChatTemplate
from spectral.lang.ir import SamplingParams

# Upper bound on the tokens generated to pick a choice (a choice of n characters has at most
# about n tokens).
MAX_SELECT_TOKENS = 64


class OpenAI(Backend):
    """`model` on the server at `base_url` (the official API when None). `api_key` defaults to
    the client's own rule (OPENAI_API_KEY) for the official API, and to "EMPTY" for a
    `base_url`, which local servers without keys accept. `chat_template` only renders
    `s.text()`; the server applies the model's own template."""

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        is_chat_model: bool = True,
        chat_template: ChatTemplate = CHATML,
    ) -> None:
        try:
            import openai
        except ImportError as err:
            raise ImportError(
                "the OpenAI backend needs the openai package: pip install openai"
            ) from err
        if api_key is None and base_url is not None:
            api_key = "EMPTY"
        self.model = model
        self.base_url = base_url
        self.is_chat_model = is_chat_model
        self.chat_template = chat_template
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key)
        self._openai = openai

    def generate(self, ctx: Context, params: SamplingParams) -> Generation:
        kwargs = self._kwargs(ctx, params, "gen")
        response = self._create(**kwargs)
        choice = response.choices[0]
        text = choice.message.content if self.is_chat_model else choice.text
        meta = {"finish_reason": choice.finish_reason}
        if response.usage is not None:
            meta["prompt_tokens"] = response.usage.prompt_tokens
            meta["completion_tokens"] = response.usage.completion_tokens
        return Generation(text or "", meta)

    def generate_stream(
        self, ctx: Context, params: SamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        kwargs = self._kwargs(ctx, params, "gen")
        meta: dict[str, Any] = {}
        for chunk in self._create(**kwargs, stream=True):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            delta = (choice.delta.content if self.is_chat_model else choice.text) or ""
            if choice.finish_reason is not None:
                meta = {"finish_reason": choice.finish_reason}
            yield delta, meta

    def select(self, ctx: Context, choices: list[str], temperature: float) -> Choice:
        """Score the choices by prompt logprobs where the server gives them (see the module
        docstring), else choose by generation. `temperature` does not change scores."""
        if not self.is_chat_model:
            scored = self._score_choices(ctx, choices)
            if scored is not None:
                return scored
        return self._select_by_generation(ctx, choices)

    def _score_choices(self, ctx: Context, choices: list[str]) -> Choice | None:
        """Mean logprob of each choice's tokens, from one echoed `completions` request (a token
        that straddles the end of the prompt counts as the choice's); None when the server
        does not score prompts."""
        try:
            response = self._create(
                model=self.model,
                prompt=[ctx.text + choice for choice in choices],
                max_tokens=0,
                echo=True,
                logprobs=0,
                temperature=0.0,
            )
        except BackendError:
            return None
        end = len(ctx.text)
        scores: list[float] = []
        by_index = sorted(response.choices, key=lambda c: c.index)
        for choice in by_index:
            lp = choice.logprobs
            if lp is None or not lp.token_logprobs or lp.text_offset is None:
                return None
            picked = [
                value
                for value, token, offset in zip(lp.token_logprobs, lp.tokens, lp.text_offset)
                if offset + len(token) > end and value is not None
            ]
            scores.append(sum(picked) / len(picked) if picked else float("-inf"))
        if len(scores) != len(choices):
            return None
        best = max(range(len(choices)), key=lambda i: (scores[i], -i))
        return Choice(choices[best], {"normalized_prompt_logprobs": scores, "method": "logprobs"})

    def _select_by_generation(self, ctx: Context, choices: list[str]) -> Choice:
        """Generate greedily (about as many tokens as the longest choice has characters) and
        choose: the longest choice the output starts with, else the most similar one."""
        budget = min(max(len(c) for c in choices) + 2, MAX_SELECT_TOKENS)
        params = SamplingParams(max_new_tokens=budget, temperature=0.0)
        generated = self.generate(ctx, params).text
        return Choice(
            _closest(generated, choices), {"generated": generated, "method": "closest_match"}
        )

    def _kwargs(self, ctx: Context, params: SamplingParams, op: str) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self.model, **params.to_openai()}
        if not self.is_chat_model:
            return {**kwargs, "prompt": ctx.text}
        if ctx.role != "assistant" or ctx.role_text:
            where = f"inside {ctx.role}()" if ctx.role else "outside any role"
            if ctx.role == "assistant":
                where = "after other text in the assistant turn"
            raise ValueError(
                f"{op}() is {where}: with a chat model it must start the assistant turn, as "
                "in assistant(gen(...)) or right after assistant_begin()"
            )
        return {**kwargs, "messages": ctx.messages}

    def _create(self, **kwargs: Any) -> Any:
        api = self.client.chat.completions if self.is_chat_model else self.client.completions
        where = self.base_url or "the OpenAI API"
        try:
            return api.create(**kwargs)
        except self._openai.APIConnectionError as err:
            raise ConnectionError(f"cannot reach {where}: {err}") from err
        except self._openai.APIStatusError as err:
            hint = ""
            if "regex" in kwargs.get("extra_body", {}):
                hint = " (gen(regex=...) needs a server that takes SGLang's regex extension)"
            raise BackendError(
                f"{where} answered HTTP {err.status_code}: {err.message}{hint}"
            ) from err


def _closest(generated: str, choices: list[str]) -> str:
    text = generated.strip().lower()
    starts = [c for c in choices if text.startswith(c.strip().lower())]
    if starts:
        return max(starts, key=len)

    def similarity(choice: str) -> float:
        target = choice.strip().lower()
        return difflib.SequenceMatcher(None, text[: len(target)], target).ratio()

    return max(choices, key=similarity)
