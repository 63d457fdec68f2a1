"""The Engine's scheduler thread: concurrent callers share the running batch, async streaming
yields growing outputs, aborts end requests."""

from __future__ import annotations

import asyncio
import threading

from tests.conftest import assert_no_leaks

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
PROMPTS = ["The moon is", "Rivers flow", "My favourite food is", "In 1969,"]


def test_concurrent_callers_get_the_same_outputs_as_one_batch(engine_fp32):
    expected = [o["output_ids"] for o in engine_fp32.generate(PROMPTS, GREEDY)]
    results: dict[int, list[int]] = {}

    def call(i: int) -> None:
        results[i] = engine_fp32.generate(PROMPTS[i], GREEDY)["output_ids"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(PROMPTS))] == expected
    assert_no_leaks(engine_fp32)


def test_async_streaming_yields_each_token_and_ends_with_the_full_output(engine_fp32):
    expected = engine_fp32.generate(PROMPTS[0], GREEDY)

    async def collect():
        return [
            chunk async for chunk in engine_fp32.async_generate(PROMPTS[0], GREEDY, stream=True)
        ]

    chunks = asyncio.run(collect())
    assert len(chunks) == 16
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 17))
    assert chunks[-1]["output_ids"] == expected["output_ids"]
    assert chunks[-1]["text"] == expected["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    assert chunks[0]["meta_info"]["finish_reason"] is None


def test_stopping_a_stream_early_aborts_the_request(engine_fp32):
    async def take_three():
        got = []
        params = {**GREEDY, "max_new_tokens": 200}
        async for chunk in engine_fp32.async_generate(PROMPTS[1], params, stream=True):
            got.append(chunk)
            if len(got) == 3:
                break
        return got

    got = asyncio.run(take_three())
    assert len(got) == 3
    assert_no_leaks(engine_fp32)


def test_abort_by_id_ends_a_running_request(engine_fp32):
    async def run():
        stream = engine_fp32.async_generate(
            PROMPTS[2], {**GREEDY, "max_new_tokens": 500}, stream=True
        )
        first = await stream.__anext__()
        engine_fp32.abort(first["meta_info"]["id"])
        last = first
        async for chunk in stream:
            last = chunk
        return last

    last = asyncio.run(run())
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 500
    assert_no_leaks(engine_fp32)
