"""The OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Every route is a named function on `router`; what it serves from is the app's `Serving`
(spectral.http.state). A request's sequences (`n`, or a list of prompts) are checked before
any starts, and share one group id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spectral.http.common import (
    OrjsonBodyRoute,
    ORJSONResponse,
    event_stream,
    run_all,
    sse,
    unless_disconnected,
)
from spectral.http.openai_format import Envelope, chat_choice, completion_choice
from spectral.http.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    finish_reason,
    now,
    usage,
)
from spectral.http.protocol import ERRORS, SSE
from spectral.http.state import Serving, ServingDep
from spectral.http.tokenizer_manager import TokenizerManager
from spectral.sampling_params import SamplingParams

# What the OpenAI routes may answer besides their success (SSE when streaming).
RESPONSES: dict[int | str, dict[str, Any]] = {200: SSE, **ERRORS}

# (choice index, prompt, parameters) of each sequence a request starts
Jobs = list[tuple[int, list[int], SamplingParams]]

router = APIRouter(route_class=OrjsonBodyRoute, default_response_class=ORJSONResponse)


@router.get("/v1/models", response_model=ModelList)
async def models(serving: ServingDep) -> dict[str, Any]:
    card = {
        "id": serving.served_model,
        "object": "model",
        "created": now(),
        "owned_by": "spectral",
    }
    return {"object": "list", "data": [card]}


@router.post("/v1/completions", response_model=CompletionResponse, responses=RESPONSES)
async def completions(body: CompletionRequest, request: Request, serving: ServingDep):
    manager = serving.manager
    params = SamplingParams.from_dict(body.sampling_dict(body.max_tokens))
    prompts = await _completion_prompts(manager, body.prompt)
    top = body.logprobs or 0
    want_logprobs = body.logprobs is not None
    jobs = prepared(serving, prompts, params, body.n, top, "logprobs")
    group = manager.new_rid()
    envelope = Envelope.new("cmpl", body.model or serving.served_model)
    if body.stream:
        return event_stream(_completion_events(manager, body, jobs, envelope, group))
    # echo with logprobs scores the prompt too (its first token has none), as OpenAI does.
    prompt_start = 0 if body.echo and want_logprobs else -1
    gens = [
        manager.generate(ids, p, None, want_logprobs, top, prompt_start, group, stream=False)
        for _, ids, p in jobs
    ]
    states = await unless_disconnected(request, run_all(gens))
    if isinstance(states, Response):
        return states
    choices = [
        completion_choice(manager, body, index, ids, s) for (index, ids, _), s in zip(jobs, states)
    ]
    prompt_tokens = sum(len(ids) for _, ids, _ in jobs)
    completion_tokens = sum(len(s.output_ids) for s in states)
    return ORJSONResponse(
        envelope.wrap("text_completion", choices, usage=usage(prompt_tokens, completion_tokens))
    )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request, serving: ServingDep):
    manager = serving.manager
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    params = SamplingParams.from_dict(body.sampling_dict(max_tokens))
    messages = [
        {"role": m.role if m.role != "developer" else "system", "content": m.text()}
        for m in body.messages
    ]
    ids = await manager.apply_chat_template(messages, body.chat_template_kwargs or {})
    top = body.top_logprobs or 0
    jobs = prepared(serving, [ids], params, body.n, top, "top_logprobs")
    group = manager.new_rid()
    envelope = Envelope.new("chatcmpl", body.model or serving.served_model)
    if body.stream:
        return event_stream(_chat_events(manager, body, jobs, envelope, group))
    gens = [
        manager.generate(ids, p, None, body.logprobs, top, group=group, stream=False)
        for _, _, p in jobs
    ]
    states = await unless_disconnected(request, run_all(gens))
    if isinstance(states, Response):
        return states
    choices = [chat_choice(manager, k, s, body.logprobs) for k, s in enumerate(states)]
    completion_tokens = sum(len(s.output_ids) for s in states)
    return ORJSONResponse(
        envelope.wrap("chat.completion", choices, usage=usage(len(ids) * body.n, completion_tokens))
    )


def prepared(
    serving: Serving,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    top: int,
    top_param: str,
) -> Jobs:
    """(choice index, prompt, parameters) of every sequence, each checked before any runs."""
    limits = serving.limits
    limits.check_sequences(len(prompts) * n, f"{len(prompts)} prompts x n={n}", "n")
    limits.check_sampling(params, "")
    limits.check_top_logprobs(top, top_param)
    jobs = [
        (i * n + k, ids, params.for_sample(k)) for i, ids in enumerate(prompts) for k in range(n)
    ]
    for _, ids, p in jobs:
        serving.manager.check(ids, p, None)
    return jobs


async def _completion_prompts(manager: TokenizerManager, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        return await manager.tokenize(prompt, "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


async def _completion_events(
    manager: TokenizerManager,
    body: CompletionRequest,
    jobs: Jobs,
    envelope: Envelope,
    group: str,
) -> AsyncIterator[bytes]:
    """A streamed /v1/completions: its choices one after another (the prompt first, with
    `echo`), then the usage where asked for."""
    total_prompt = total_completion = 0
    want_logprobs, top = body.logprobs is not None, body.logprobs or 0
    for index, ids, p in jobs:
        sent = 0
        if body.echo:
            yield sse(envelope.completion_chunk(index, manager.tokenizer.decode(ids), None))
        async for state in manager.generate(ids, p, None, want_logprobs, top, group=group):
            delta, sent = state.text[sent:], len(state.text)
            yield sse(envelope.completion_chunk(index, delta, finish_reason(state.finish_reason)))
        total_prompt += len(ids)
        total_completion += len(state.output_ids)
    if body.stream_options and body.stream_options.include_usage:
        yield sse(envelope.usage_chunk("text_completion", total_prompt, total_completion))


async def _chat_events(
    manager: TokenizerManager,
    body: ChatCompletionRequest,
    jobs: Jobs,
    envelope: Envelope,
    group: str,
) -> AsyncIterator[bytes]:
    """A streamed /v1/chat/completions: its choices one after another, each opening with the
    assistant's role, then the usage where asked for."""
    completion = 0
    top = body.top_logprobs or 0
    for k, ids, p in jobs:
        sent = 0
        first = {"role": "assistant", "content": ""}
        yield sse(envelope.chat_chunk(k, first, None))
        async for state in manager.generate(ids, p, None, body.logprobs, top, group=group):
            delta, sent = state.text[sent:], len(state.text)
            reason = finish_reason(state.finish_reason)
            yield sse(envelope.chat_chunk(k, {"content": delta}, reason))
        completion += len(state.output_ids)
    if body.stream_options and body.stream_options.include_usage:
        prompt = len(jobs[0][1]) * body.n
        yield sse(envelope.usage_chunk("chat.completion.chunk", prompt, completion))
