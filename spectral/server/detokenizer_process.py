"""The detokenizer process: turns the scheduler's token ids into text deltas per request and
passes everything else (control replies, rejections) through to the tokenizer manager."""

from __future__ import annotations

import os

import zmq

from spectral.args import ServerArgs
from spectral.models.resolve import resolve_model_path
from spectral.server.child import parse_child_args, wait_for_work
from spectral.server.detokenizer import IncrementalDetokenizer
from spectral.server.ipc import recv_message, send_message
from spectral.server.messages import BatchStrOut, BatchTokenIDOut, ProcessReady


def detokenizer_main(args: ServerArgs, ipc_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer_path or resolve_model_path(args.model_path, args.model_cache_dir)
    )
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{ipc_dir}/detokenizer_in")
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(f"ipc://{ipc_dir}/tokenizer_in")
    ready = ctx.socket(zmq.PUSH)
    ready.connect(f"ipc://{ipc_dir}/ready")
    send_message(ready, ProcessReady("detokenizer", {}))
    ready.close(linger=1000)

    states: dict[str, IncrementalDetokenizer] = {}
    parent = os.getppid()
    while wait_for_work(inbox, parent):
        msg = recv_message(inbox)
        if not isinstance(msg, BatchTokenIDOut):
            send_message(outbox, msg)
            continue
        deltas = []
        for i, rid in enumerate(msg.rids):
            state = states.get(rid)
            if state is None:
                state = states[rid] = IncrementalDetokenizer(
                    tokenizer, msg.stop[i], msg.skip_special_tokens[i], msg.no_stop_trim[i]
                )
            delta = state.push(msg.new_ids[i])
            if msg.finished_reasons[i] is not None:
                delta += state.finish()
                del states[rid]
            deltas.append(delta)
        send_message(
            outbox,
            BatchStrOut(
                msg.rids, deltas, msg.new_ids, msg.new_logprobs, msg.finished_reasons, msg.meta
            ),
        )


def main() -> None:
    args, ns = parse_child_args("detokenizer")
    detokenizer_main(args, ns.ipc_dir)


if __name__ == "__main__":
    main()
