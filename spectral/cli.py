"""The `spectral` command: `serve` runs the HTTP server, `demo` an offline generation demo,
`token-map` writes a draft's hot-token map, `datastore build` a REST datastore,
`train-eagle3` trains a draft head, `train-medusa` trains Medusa heads."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from spectral.args import ServerArgs

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain in one sentence what a hash table is.",
]


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def run_demo(args: ServerArgs, max_new_tokens: int) -> None:
    from spectral.engine import Engine

    start = time.perf_counter()
    engine = Engine(**vars(args))
    print(
        f"loaded {args.model_path} in {time.perf_counter() - start:.1f}s "
        f"(dtype {engine.worker.dtype}, KV pool {engine.worker.num_kv_slots} tokens)"
    )
    prompts = [chat_prompt(engine.tokenizer, q) for q in DEMO_PROMPTS]
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    for question, out in zip(DEMO_PROMPTS, outputs):
        print(f"\n>>> {question}\n{out['text'].strip()}")
    print(
        f"\n{tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s, batch {len(prompts)})"
    )
    engine.shutdown()


def token_map_main(argv: list[str]) -> None:
    """`spectral token-map`: a hot-token map for --speculative-token-map from text files."""
    from spectral.models.resolve import model_files_dir
    from spectral.models.resolved import load_tokenizer
    from spectral.speculative.drafters.token_map import (
        DEFAULT_SIZE,
        build_token_map,
        corpus_texts,
        save_token_map,
    )

    parser = argparse.ArgumentParser(
        prog="spectral token-map",
        description="Write a hot-token map for --speculative-token-map: the special tokens, "
        "the tokens of the given text files by frequency, then the lowest ids.",
    )
    parser.add_argument("--model", required=True, help="the model (or draft model) path")
    parser.add_argument("--output", required=True, help="the map to write (.json, else .pt)")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="token ids to keep")
    parser.add_argument(
        "--suffixes", default=".py,.txt,.md,.json,.jsonl", help="files read in a directory"
    )
    parser.add_argument("corpus", nargs="*", help="text files or directories (none: ids only)")
    ns = parser.parse_args(argv)
    tokenizer = load_tokenizer(model_files_dir(ns.model))
    texts = corpus_texts(ns.corpus, tuple(ns.suffixes.split(",")))
    try:
        ids = build_token_map(texts, tokenizer, len(tokenizer), ns.size)
    except ValueError as err:
        parser.error(str(err))
    save_token_map(ids, ns.output)
    print(f"wrote {len(ids)} of {len(tokenizer)} token ids to {ns.output}")


def datastore_main(argv: list[str]) -> None:
    """`spectral datastore build`: a REST datastore for --speculative-datastore."""
    from spectral.models.resolve import model_files_dir
    from spectral.models.resolved import load_tokenizer
    from spectral.speculative.sources.datastore import build

    parser = argparse.ArgumentParser(
        prog="spectral datastore",
        description="Build a datastore for REST drafting (--speculative-datastore): text "
        "files, directories (their source and text files) and JSONL files (a record's "
        "text, content or code field) tokenized with the model's tokenizer, their suffixes "
        "sorted, written as .npy files with a manifest.",
    )
    parser.add_argument("action", choices=["build"])
    parser.add_argument("--model", required=True, help="the served model (its tokenizer)")
    parser.add_argument("--output", required=True, help="the datastore directory to write")
    parser.add_argument("sources", nargs="+", help="files, directories, JSONL files")
    ns = parser.parse_args(argv)
    tokenizer = load_tokenizer(model_files_dir(ns.model))
    try:
        manifest = build(tokenizer, ns.sources, ns.output, model=ns.model)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    print(
        f"wrote {ns.output}: {manifest['tokens']:,} tokens of {manifest['documents']:,} "
        f"documents, {manifest['bytes'] / 2**20:.1f} MiB, in {manifest['build_seconds']} s"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "train-eagle3":
        from spectral.training.train import main as train_main

        train_main(argv[1:])
        return
    if argv and argv[0] == "train-medusa":
        from spectral.training.medusa_train import main as medusa_main

        medusa_main(argv[1:])
        return
    if argv and argv[0] == "token-map":
        token_map_main(argv[1:])
        return
    if argv and argv[0] == "datastore":
        datastore_main(argv[1:])
        return
    parser = argparse.ArgumentParser(
        prog="spectral",
        epilog="spectral train-eagle3 --help: train an EAGLE-3 draft head; spectral "
        "train-medusa --help: train Medusa heads; spectral token-map "
        "--help: a draft's hot-token map; spectral datastore build --help: a REST datastore",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server (native and OpenAI-compatible API)")
    ServerArgs.add_cli_args(serve)
    demo = sub.add_parser("demo", help="generate for a few prompts offline and print the speed")
    ServerArgs.add_cli_args(demo)
    demo.add_argument("--demo-max-new-tokens", type=int, default=96)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns)
    except ValueError as err:
        parser.error(str(err))
    if ns.command == "serve":
        from spectral.launch_server import launch_server

        launch_server(args)
    else:
        logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
        run_demo(args, ns.demo_max_new_tokens)


if __name__ == "__main__":
    main(sys.argv[1:])
