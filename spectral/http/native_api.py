"""SGLang's native endpoints (the OpenAI-compatible ones are in openai_api.py): health, model
and server info, load, metrics, cache flush, abort, and `/generate`.

Every route is a named function on `router`; what it serves from is the app's `Serving`
(spectral.http.state). A client that disconnects mid-request has its request aborted (the
generator's cleanup sends the abort).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spectral.http.common import (
    OrjsonBodyRoute,
    ORJSONResponse,
    event_stream,
    merged,
    run_all,
    sse,
    unless_disconnected,
)
from spectral.http.protocol import (
    ERRORS,
    SSE,
    AbortRequest,
    GenerateRequest,
    GenerateResponse,
    Job,
    MessageResponse,
    ModelInfo,
)
from spectral.http.state import ServingDep
from spectral.http.tokenizer_manager import ReqState, TokenizerManager
from spectral.sampling_params import InvalidRequestError, SamplingParams

router = APIRouter(route_class=OrjsonBodyRoute, default_response_class=ORJSONResponse)


@router.get("/health", response_class=Response, responses={200: {"description": "serving"}})
async def health() -> Response:
    return Response(status_code=200)


@router.get(
    "/health_generate",
    response_class=Response,
    responses={200: {"description": "a one-token generation ran"}, **ERRORS},
)
async def health_generate(serving: ServingDep) -> Response:
    params = SamplingParams(max_new_tokens=1)
    [ids] = await serving.manager.tokenize("ping")
    async for _ in serving.manager.generate(ids, params):
        pass
    return Response(status_code=200)


# SGLang serves these under both names (sglang-router and newer SGLang clients ask for
# /server_info and /model_info first).
@router.get("/get_model_info", response_model=ModelInfo, responses=ERRORS)
@router.get("/model_info", response_model=ModelInfo, responses=ERRORS)
async def model_info(serving: ServingDep) -> dict[str, Any]:
    info = serving.info
    return {
        "model_path": serving.served_model,
        "tokenizer_path": info.get("tokenizer_path"),
        "is_generation": True,
        "context_length": info.get("context_length"),
        "model_type": info.get("model_type"),
        "architectures": info.get("architectures"),
        "features": info.get("features"),
        "quantization": info.get("quantization"),
    }


@router.get("/get_server_info", response_model=dict[str, Any], responses=ERRORS)
@router.get("/server_info", response_model=dict[str, Any], responses=ERRORS)
async def server_info(serving: ServingDep) -> dict[str, Any]:
    state = await serving.manager.control("server_info")
    # SGLang's per-rank state; bench_serving reports the accept length from it.
    internal = {"avg_spec_accept_length": state["stats"].get("spec_accept_length") or None}
    return {**serving.info, **state, "internal_states": [internal]}


@router.get("/get_load", response_model=list[dict[str, int]], responses=ERRORS)
async def get_load(serving: ServingDep) -> list[dict[str, int]]:
    """SGLang's load report (sglang-router's power-of-two policy reads num_tokens)."""
    state = await serving.manager.control("server_info")
    memory = state["memory"]
    held = memory["total_tokens"] - memory["free_tokens"] - memory["evictable_tokens"]
    return [
        {
            "dp_rank": 0,
            "num_reqs": state["requests"]["running"],
            "num_waiting_reqs": state["requests"]["waiting"],
            "num_tokens": held,
        }
    ]


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(serving: ServingDep) -> Response:
    manager = serving.manager
    body = manager.metrics.render(await manager.control("server_info"))
    return Response(body, media_type="text/plain; version=0.0.4")


@router.api_route(
    "/flush_cache", methods=["GET", "POST"], response_model=MessageResponse, responses=ERRORS
)
async def flush_cache(serving: ServingDep) -> ORJSONResponse:
    result = await serving.manager.control("flush_cache")
    if result.get("success"):
        return ORJSONResponse({"message": "Cache flushed."})
    raise InvalidRequestError("cannot flush the cache while requests are running or waiting")


@router.post("/abort_request", response_model=dict[str, Any], responses=ERRORS)
async def abort_request(body: AbortRequest, serving: ServingDep) -> dict[str, Any]:
    await serving.manager.abort(body.rid)
    return {}


@router.post(
    "/generate",
    response_model=GenerateResponse | list[GenerateResponse],
    responses={
        200: SSE,
        **ERRORS,
    },
)
async def generate(body: GenerateRequest, request: Request, serving: ServingDep):
    manager = serving.manager
    jobs = body.jobs(serving.limits)
    prompts = await _prompts(manager, body)
    _check_jobs(manager, body, jobs, prompts)
    group = manager.new_rid() if len(jobs) > 1 else None
    gens = [
        manager.generate(
            prompts[job.prompt],
            job.params,
            job.rid,
            job.return_logprob,
            job.top_logprobs_num,
            job.logprob_start_len,
            group,
            body.stream,
        )
        for job in jobs
    ]
    token_text = manager.token_text if body.return_text_in_logprobs else None
    if body.stream:
        return event_stream(_generate_events(body, gens, token_text))
    outs = await unless_disconnected(request, run_all(gens))
    if isinstance(outs, Response):
        return outs
    outputs = [o.output(token_text) for o in outs]
    return ORJSONResponse(outputs if body.answers_a_list else outputs[0])


async def _prompts(manager: TokenizerManager, body: GenerateRequest) -> list[list[int]]:
    """The token ids of each prompt of a /generate request."""
    if body.text is not None:
        return await manager.tokenize(body.text)
    return [body.input_ids] if not body.is_batch else body.input_ids


def _check_jobs(
    manager: TokenizerManager, body: GenerateRequest, jobs: list[Job], prompts: list[list[int]]
) -> None:
    """Refuse the whole request if any of its sequences can never run (before any starts)."""
    for job in jobs:
        ids = prompts[job.prompt]
        start = job.logprob_start_len if job.return_logprob else -1
        try:
            manager.check(ids, job.params, job.rid, start)
        except InvalidRequestError as err:
            raise batch_error(err, job.prompt, body.is_batch) from None


async def _generate_events(
    body: GenerateRequest,
    gens: list[AsyncIterator[ReqState]],
    token_text: Callable[[int], str] | None,
) -> AsyncIterator[bytes]:
    """A streamed /generate: one event per update (with its `index` when the answer is a
    list)."""
    if not body.answers_a_list:
        async for state in gens[0]:
            yield sse(state.output(token_text))
        return
    async for index, out in merged(gens, lambda s: s.output(token_text)):
        yield sse({**out, "index": index})


def batch_error(err: InvalidRequestError, index: int, is_batch: bool) -> InvalidRequestError:
    """`err` about the index-th prompt of a batch says which one it is about."""
    if not is_batch:
        return err
    return InvalidRequestError(f"prompt {index}: {err}", err.param)
