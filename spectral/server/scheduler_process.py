"""The scheduler process: receives tokenized requests and aborts, runs the Scheduler over its
model worker (held in this process, or a child process of its own with --worker-process or
--tp-size > 1), and sends new tokens to the detokenizer: a streamed request's every
`--stream-interval` tokens, another's when it finishes."""

from __future__ import annotations

import logging
import sys
import time

import zmq

from spectral.args import ServerArgs
from spectral.core.req import Req, TokenizedRequest
from spectral.faults import failure
from spectral.mem.process import freeze_heap, share_thread_arenas
from spectral.sampling_params import InvalidRequestError
from spectral.server.child import exit_on_sigterm, parse_child_args, receive_model
from spectral.server.ipc import recv_message, send_message
from spectral.server.messages import (
    AbortReq,
    BatchTokenIDOut,
    ControlOut,
    ControlReq,
    ProcessReady,
    RequestRejected,
)
from spectral.server.worker_process import RemoteWorker, WorkerDiedError

logger = logging.getLogger("spectral.scheduler")


def news_due(req: Req, sent: int, stream_interval: int) -> bool:
    """Whether the news of a request with `sent` output tokens sent goes out now: when it has
    finished; a stream's first token at once, then every `stream_interval` tokens (its own
    sampling param's where given); a request that does not stream gets all when it finishes."""
    if req.finished:
        return True
    if not req.stream:
        return False
    every = req.sampling_params.stream_interval or stream_interval
    return sent == 0 or len(req.output_ids) - sent >= every


class SchedulerProcess:
    def __init__(self, args: ServerArgs, ipc_dir: str) -> None:
        # A worker process of its own (--worker-process, --tp-size > 1) starts first: its load
        # is the longest part of the start-up, and both import while the launching process
        # resolves the model, which it hands to each. By default this process holds the worker
        # (as SGLang's scheduler holds its TpModelWorker): a step then hands nothing between
        # processes, which on a CPU whose cores the forward fills costs ~1 ms a step.
        self.remote = RemoteWorker(args, ipc_dir) if args.worker_in_own_process() else None
        from spectral.models.resolved import load_tokenizer
        from spectral.scheduler.scheduler import build_scheduler

        model = receive_model(ipc_dir, "scheduler")
        tokenizer = load_tokenizer(model.tokenizer_dir)
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(f"ipc://{ipc_dir}/scheduler_in")
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(f"ipc://{ipc_dir}/detokenizer_in")
        if self.remote is not None:
            worker = self.remote.wait_ready()
        else:
            from spectral.worker.factory import create_worker

            worker = create_worker(args, model)
        self.scheduler = build_scheduler(args, model, worker, tokenizer)
        self.stream_interval = args.stream_interval
        self.sent: dict[str, int] = {}  # output ids already sent, per request in flight
        ready = self.ctx.socket(zmq.PUSH)
        ready.connect(f"ipc://{ipc_dir}/ready")
        send_message(ready, ProcessReady("scheduler", {"num_kv_slots": worker.num_kv_slots}))
        ready.close(linger=1000)
        self.scheduler.grammars.start()

    def run(self) -> None:
        while True:
            if self.remote is not None:
                self.remote.check_alive()
            self._receive(block=not self.scheduler.has_work)
            if self.scheduler.has_work:
                self._emit(self.scheduler.step())
                for rid, why in self.scheduler.grammars.take_rejected():
                    self.sent.pop(rid, None)
                    send_message(self.outbox, RequestRejected(rid, why))

    def _receive(self, block: bool) -> None:
        timeout = 100 if block else 0
        while self.inbox.poll(timeout):
            timeout = 0
            msg = recv_message(self.inbox)
            if isinstance(msg, TokenizedRequest):
                self._add(msg)
            elif isinstance(msg, AbortReq):
                req = self.scheduler.abort(msg.rid)
                if req is not None:
                    self._emit([req])
            elif isinstance(msg, ControlReq):
                send_message(self.outbox, ControlOut(msg.call_id, self._control(msg.name)))

    def _add(self, msg: TokenizedRequest) -> None:
        req = Req.of(msg)
        try:
            self.scheduler.add_request(req)
        except InvalidRequestError as err:
            send_message(self.outbox, RequestRejected(msg.rid, str(err)))
            return
        except Exception as err:
            logger.exception("adding request %s failed", msg.rid)
            send_message(self.outbox, RequestRejected(msg.rid, failure("scheduler", err), 500))
            return
        self.sent[req.rid] = 0

    def _control(self, name: str) -> dict:
        s = self.scheduler
        if name == "flush_cache":
            return {"success": s.flush_cache()}
        if name == "server_info":
            return s.info()
        return {"error": f"unknown control call {name!r}"}

    def _emit(self, reqs: list[Req]) -> None:
        """Send the news of `reqs` to the detokenizer. A request whose news cannot be put
        together is aborted and its client told why; the others' news goes out."""
        out = BatchTokenIDOut([], [], [], [], [], [])
        for req in reqs:
            sent = self.sent.get(req.rid, 0)
            if not news_due(req, sent, self.stream_interval):
                continue
            try:
                self._add_news(out, req, sent)
            except Exception as err:
                logger.exception("sending the output of request %s failed", req.rid)
                self.scheduler.abort(req.rid)
                self.sent.pop(req.rid, None)
                send_message(self.outbox, RequestRejected(req.rid, failure("scheduler", err), 500))
        if out.rids:
            send_message(self.outbox, out)

    def _add_news(self, out: BatchTokenIDOut, req: Req, start: int) -> None:
        """Add `req`'s output from its `start`-th token on (what is not sent yet) to `out`."""
        new = req.output_ids[start:]
        p = req.sampling_params
        logprobs = []
        if req.return_logprob:
            tops = req.output_top_logprobs[start:] if req.top_logprobs_num else [None] * len(new)
            logprobs = [
                [lp, tok, top] for lp, tok, top in zip(req.output_logprobs[start:], new, tops)
            ]
        meta = req.usage()
        first = start == 0 and (new or req.finished)
        if first and req.return_logprob and req.logprob_start_len >= 0:
            meta["input_token_logprobs"] = req.input_token_logprobs()
        if req.finished:
            meta["e2e_latency"] = (req.finished_at or time.perf_counter()) - req.created_at
        reason = req.finished_reason.to_dict() if req.finished else None
        self.sent[req.rid] = len(req.output_ids)
        if req.finished:
            self.sent.pop(req.rid, None)
        out.rids.append(req.rid)
        out.new_ids.append(new)
        out.new_logprobs.append(logprobs)
        out.finished_reasons.append(reason)
        out.meta.append(meta)
        out.params.append(p if start == 0 else None)


def main() -> None:
    share_thread_arenas()  # before any thread: grammar compiles' arenas as one
    args, ns = parse_child_args("scheduler")
    exit_on_sigterm()  # through `finally`, so that the worker process is stopped with us
    process = SchedulerProcess(args, ns.ipc_dir)
    freeze_heap()
    try:
        process.run()
    except WorkerDiedError as err:
        logger.error("%s; shutting down", err)
        sys.exit(1)
    finally:
        if process.remote is not None:
            process.remote.close()


if __name__ == "__main__":
    main()
