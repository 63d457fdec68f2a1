"""launch_server: start the detokenizer and scheduler processes (the scheduler starts the model
worker), wait until each reports ready, then serve HTTP. A child that dies takes the server
down with a clear message and a non-zero exit; SIGINT/SIGTERM stop every child."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

import uvicorn
import zmq

from spectral.args import ServerArgs
from spectral.models.registry import UnsupportedModelError, check_model_dir
from spectral.models.resolve import ModelNotFoundError, model_files_dir
from spectral.server.child import hand_model, spawn_child, stop_children
from spectral.server.ipc import recv_message
from spectral.server.messages import ProcessReady

logger = logging.getLogger("spectral.server")

READY_TIMEOUT_S = 900


def _wait_ready(sock: zmq.Socket, children: dict[str, subprocess.Popen]) -> dict[str, dict]:
    ready: dict[str, dict] = {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(ready) < len(children):
        for name, proc in children.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the {name} process exited with code {proc.returncode} while starting"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"processes not ready after {READY_TIMEOUT_S} s: {set(children) - set(ready)}"
            )
        if sock.poll(200):
            msg = recv_message(sock)
            if isinstance(msg, ProcessReady):
                ready[msg.role] = msg.info
    return ready


def launch_server(args: ServerArgs) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    if args.node_rank > 0:  # another machine's tensor-parallel ranks; node 0 serves
        from spectral.server.tp_group import serve_node

        serve_node(args)
        return
    if args.dp_size > 1 or args.worker_urls:
        from spectral.server.data_parallel import serve_data_parallel

        serve_data_parallel(args)
        return
    # The model's files (a GGUF's extracted once) checked before the children start; they
    # import their modules while this process resolves the model, then each gets it as its
    # first message.
    try:
        check_model_dir(model_files_dir(args.model_path, args.model_cache_dir))
    except (ModelNotFoundError, UnsupportedModelError) as err:
        sys.exit(f"spectral: {err}")
    ipc_dir = tempfile.mkdtemp(prefix="spectral-")  # mode 0700
    ctx = zmq.Context()
    ready_sock = ctx.socket(zmq.PULL)
    ready_sock.bind(f"ipc://{ipc_dir}/ready")
    children = {
        "detokenizer": spawn_child("spectral.server.detokenizer_process", args, ipc_dir),
        "scheduler": spawn_child("spectral.server.scheduler_process", args, ipc_dir),
    }
    model_out: list[zmq.Socket] = []
    exit_code = 0
    try:
        # (imported here, after the children started: transformers and torch take seconds)
        from spectral.models.resolved import resolve_model
        from spectral.server.http_server import create_app
        from spectral.server.protocol import RequestLimits
        from spectral.server.tokenizer_manager import TokenizerManager

        try:
            model, tokenizer = resolve_model(args)
        except (ModelNotFoundError, UnsupportedModelError) as err:
            raise RuntimeError(f"spectral: {err}") from None
        # to the model worker too, which the scheduler process has started
        model_out = [hand_model(ctx, ipc_dir, role, model) for role in [*children, "worker"]]
        info = _wait_ready(ready_sock, children)["scheduler"]
        for sock in model_out:
            sock.close(0)
        ready_sock.close(0)
        served = args.served_model_name or args.model_path
        state: dict[str, TokenizerManager] = {}

        async def watch_children(server: uvicorn.Server) -> None:
            nonlocal exit_code
            while not server.should_exit:
                for name, proc in children.items():
                    if proc.poll() is not None:
                        logger.error(
                            "the %s process exited with code %s; shutting down",
                            name,
                            proc.returncode,
                        )
                        exit_code = 1
                        server.should_exit = True
                        return
                await asyncio.sleep(0.2)

        manager = TokenizerManager(
            tokenizer,
            ipc_dir,
            model.context_len,
            model.vocab_size,
            info["num_kv_slots"],
        )
        state["manager"] = manager
        public_args = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
        # What /get_server_info and /get_model_info say besides the scheduler's state, in
        # SGLang's names (sglang-router reads the sizes and the model's names from them).
        server_info = {
            "model_path": args.model_path,
            "served_model_name": served,
            "tokenizer_path": model.tokenizer_dir,
            "model_type": model.model_type,
            "architectures": [model.architecture],
            "features": model.features,
            "context_length": model.context_len,
            "max_total_tokens": info["num_kv_slots"],
            "tp_size": 1,
            "dp_size": 1,
            "version": version("spectral"),
            "server_args": public_args,
        }
        app = create_app(manager, served, server_info, args.api_key, RequestLimits(args))
        config = uvicorn.Config(
            app,
            timeout_graceful_shutdown=5,
            host=args.host,
            port=args.port,
            loop="uvloop",
            log_level=args.log_level,
            timeout_keep_alive=5,
        )
        server = uvicorn.Server(config)

        async def serve() -> None:
            manager.start()
            watcher = asyncio.create_task(watch_children(server))
            await server.serve()
            watcher.cancel()

        logger.info("serving %s on http://%s:%d", served, args.host, args.port)
        asyncio.run(serve())
    except RuntimeError as err:
        logger.error("%s", err)
        exit_code = 1
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        stop_children(children.values())
        for sock in [ready_sock, *model_out]:
            sock.close(0)  # an open socket would keep ctx.term() waiting forever
        ctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)
    if exit_code:
        sys.exit(exit_code)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="spectral.launch_server")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns)
    except ValueError as err:
        parser.error(str(err))
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    launch_server(args)


if __name__ == "__main__":
    main()
