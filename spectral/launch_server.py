"""`python -m spectral.launch_server --model-path ...` (and `spectral serve`): start the server's
processes (spectral.server), wait until each reports ready, then serve HTTP in front of them
(spectral.http) with uvicorn. A child that dies takes the server down with a clear message and
a non-zero exit; SIGINT/SIGTERM stop every child."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import uvicorn

from spectral.args import ServerArgs
from spectral.server.launch import ServerProcesses, check_model_files

if TYPE_CHECKING:
    from spectral.http.tokenizer_manager import TokenizerManager

logger = logging.getLogger("spectral.server")


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
    check_model_files(args)
    processes = ServerProcesses(args)
    exit_code = 0
    try:
        exit_code = _serve_http(args, processes)
    except RuntimeError as err:
        logger.error("%s", err)
        exit_code = 1
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        processes.close()
    if exit_code:
        sys.exit(exit_code)


def _serve_http(args: ServerArgs, processes: ServerProcesses) -> int:
    """Serve the app once the processes are ready, until uvicorn stops: 1 if a child exited,
    else 0."""
    # (imported here, after the children started: transformers and torch take seconds)
    from spectral.http.app import create_app
    from spectral.http.protocol import RequestLimits
    from spectral.http.state import server_info
    from spectral.http.tokenizer_manager import TokenizerManager

    model, tokenizer, ready = processes.start(args)
    num_kv_slots = ready["num_kv_slots"]
    manager = TokenizerManager(
        tokenizer, processes.ipc_dir, model.context_len, model.vocab_size, num_kv_slots
    )
    served = args.served_model_name or args.model_path
    info = server_info(args, model, num_kv_slots)
    app = create_app(manager, served, info, args.api_key, RequestLimits(args))
    config = uvicorn.Config(
        app,
        timeout_graceful_shutdown=5,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=5,
    )
    logger.info("serving %s on http://%s:%d", served, args.host, args.port)
    try:
        import uvloop  # libuv's event loop (uvicorn.Config's `loop` is read by uvicorn.run only)
    except ImportError:  # not on Windows
        return asyncio.run(_serve(uvicorn.Server(config), manager, processes))
    return uvloop.run(_serve(uvicorn.Server(config), manager, processes))


async def _serve(
    server: uvicorn.Server, manager: TokenizerManager, processes: ServerProcesses
) -> int:
    manager.start()
    watcher = asyncio.create_task(_watch_children(server, processes))
    await server.serve()
    child_exited = watcher.done() and watcher.result()
    watcher.cancel()
    return 1 if child_exited else 0


async def _watch_children(server: uvicorn.Server, processes: ServerProcesses) -> bool:
    """Stop the server as soon as a child process exits (True), or return when it stops."""
    while not server.should_exit:
        exited = processes.exited()
        if exited is not None:
            logger.error("the %s process exited with code %s; shutting down", *exited)
            server.should_exit = True
            return True
        await asyncio.sleep(0.2)
    return False


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
