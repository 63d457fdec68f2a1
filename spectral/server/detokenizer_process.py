"""The detokenizer process: turns the scheduler's token ids into text deltas per request and
passes everything else (control replies, rejections) through to the tokenizer manager."""

from __future__ import annotations

import logging
import os
from typing import Any

import zmq

from spectral import faults
from spectral.faults import failure
from spectral.mem.process import freeze_heap
from spectral.server.child import parse_child_args, receive_model, wait_for_work
from spectral.server.detokenizer import IncrementalDetokenizer, load_decoder
from spectral.server.ipc import recv_message, send_message
from spectral.server.messages import (
    BatchStrOut,
    BatchTokenIDOut,
    ProcessReady,
    RequestRejected,
)

logger = logging.getLogger("spectral.detokenizer")


def detokenizer_main(ipc_dir: str) -> None:
    tokenizer = load_decoder(receive_model(ipc_dir, "detokenizer").tokenizer_dir)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{ipc_dir}/detokenizer_in")
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(f"ipc://{ipc_dir}/tokenizer_in")
    freeze_heap()
    ready = ctx.socket(zmq.PUSH)
    ready.connect(f"ipc://{ipc_dir}/ready")
    send_message(ready, ProcessReady("detokenizer", {}))
    ready.close(linger=1000)

    states: dict[str, IncrementalDetokenizer] = {}
    failed: set[str] = set()  # requests whose text failed; their tokens are dropped
    parent = os.getppid()
    while wait_for_work(inbox, parent):
        msg = recv_message(inbox)
        if not isinstance(msg, BatchTokenIDOut):
            if isinstance(msg, RequestRejected):
                states.pop(msg.rid, None)
            send_message(outbox, msg)
            continue
        keep, deltas = [], []
        for i, rid in enumerate(msg.rids):
            finished = msg.finished_reasons[i] is not None
            if rid in failed:
                if finished:
                    failed.discard(rid)
                continue
            try:
                faults.inject("detokenizer", rid)
                delta = _text_delta(states, tokenizer, msg, i)
            except Exception as err:
                logger.exception("detokenizing request %s failed", rid)
                states.pop(rid, None)
                if not finished:
                    failed.add(rid)
                send_message(outbox, RequestRejected(rid, failure("detokenizer", err), 500))
                continue
            keep.append(i)
            deltas.append(delta)
        if keep:
            send_message(
                outbox,
                BatchStrOut(
                    [msg.rids[i] for i in keep],
                    deltas,
                    [msg.new_ids[i] for i in keep],
                    [msg.new_logprobs[i] for i in keep],
                    [msg.finished_reasons[i] for i in keep],
                    [msg.meta[i] for i in keep],
                ),
            )


def _text_delta(
    states: dict[str, IncrementalDetokenizer], tokenizer: Any, msg: BatchTokenIDOut, i: int
) -> str:
    """Request i's new text; its state is created on its first tokens, dropped on its last."""
    rid = msg.rids[i]
    state = states.get(rid)
    if state is None:
        state = states[rid] = IncrementalDetokenizer(tokenizer, msg.params[i])
    delta = state.push(msg.new_ids[i])
    if msg.finished_reasons[i] is not None:
        delta += state.finish()
        del states[rid]
    return delta


def main() -> None:
    _, ns = parse_child_args("detokenizer")
    detokenizer_main(ns.ipc_dir)


if __name__ == "__main__":
    main()
