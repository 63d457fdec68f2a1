"""Messages cross processes as an orjson header plus raw array frames, never pickle."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import zmq

import spectral.server.messages  # noqa: F401  (registers the message types)
from spectral.core.forward import ForwardMode
from spectral.core.worker_io import RequestSampling, WorkerBatch, WorkerResult
from spectral.sampling_params import SamplingParams
from spectral.server.ipc import MessageError, decode, encode, message, recv_message, send_message


@message
@dataclass
class Probe:
    name: str
    values: np.ndarray
    hidden: torch.Tensor
    extra: dict = field(default_factory=dict)


def sample_batch() -> WorkerBatch:
    return WorkerBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=[5, 6, 7],
        positions=[10, 11, 11],
        out_cache_loc=[100, 101, 102],
        req_pool_indices=[3],
        prefix_lens=[10],
        extend_lens=[3],
        sampling=[
            RequestSampling(
                SamplingParams(temperature=0.7, stop=["\n"], seed=4),
                output_ids=[1, 2],
                return_logprob=True,
            )
        ],
        table_writes=[(3, 0, [1, 2, 3])],
        custom_mask=[True, False, False, True, True, False, True, False, True],
    )


def test_worker_batch_round_trips_with_nested_types():
    batch = sample_batch()
    back = decode(encode(batch))
    assert back.mode is ForwardMode.TARGET_VERIFY
    assert back.sampling[0].params == batch.sampling[0].params
    assert back.table_writes == [[3, 0, [1, 2, 3]]]  # tuples arrive as lists
    assert back.input_ids == batch.input_ids and back.custom_mask == batch.custom_mask


def test_a_hybrid_round_sends_given_trees_beside_head_drafted_ones():
    batch = sample_batch()
    batch.draft_tokens, batch.draft_parents = [None, [8, 9]], [None, [0, 1]]
    back = decode(encode(batch))
    assert back.draft_tokens == [None, [8, 9]] and back.draft_parents == [None, [0, 1]]


def test_arrays_and_tensors_travel_as_raw_frames():
    probe = Probe(
        name="p",
        values=np.arange(12, dtype=np.float32).reshape(3, 4),
        hidden=torch.randn(2, 5).to(torch.bfloat16),
        extra={"ids": [1, 2], "empty": np.zeros((0, 3), dtype=np.int64)},
    )
    frames = encode(probe)
    assert len(frames) == 4  # header + three arrays
    assert b"0.0" not in bytes(frames[0])  # array contents are not in the JSON header
    back = decode(frames)
    assert np.array_equal(back.values, probe.values) and back.values.dtype == np.float32
    assert back.hidden.dtype == torch.bfloat16 and torch.equal(back.hidden, probe.hidden)
    assert back.extra["empty"].shape == (0, 3)


def test_unregistered_types_are_refused_with_the_field_named():
    @dataclass
    class Unregistered:
        x: int

    with pytest.raises(MessageError, match="not a registered message type"):
        encode(Unregistered(1))
    with pytest.raises(MessageError, match=r"message\.extra\.f: cannot send a function"):
        encode(Probe("p", np.zeros(1), torch.zeros(1), {"f": lambda: None}))


def test_malformed_or_unknown_messages_are_refused():
    with pytest.raises(MessageError, match="unknown message type 'Nope'"):
        decode([b'{"__message__": "Nope", "fields": {}}'])
    with pytest.raises(MessageError, match="not JSON"):
        decode([b"\x80\x03pickle"])
    with pytest.raises(MessageError, match="missing frame"):
        decode([b'{"__array__": 3, "dtype": "<f4", "shape": [1]}'])


def test_messages_cross_a_zmq_ipc_socket():
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        addr = f"ipc://{tmp}/test.sock"
        pull = ctx.socket(zmq.PULL)
        pull.bind(addr)
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)
        result = WorkerResult(
            next_token_ids=[7, 8], logprobs=[-0.5, None], top_logprobs=[None, None]
        )
        send_message(push, sample_batch())
        send_message(push, result)
        assert recv_message(pull).extend_lens == [3]
        assert recv_message(pull) == result
        push.close(0)
        pull.close(0)
    ctx.term()
