"""schemathesis against a live spectral server's OpenAPI document: valid and invalid requests
for every operation, generated from the document. No answer may be a 5xx, every status, content
type and body must be the documented one, and data the document rules out must be refused.

`python -m tests.fuzz [--examples N]` starts a server on the default model (64-token context,
so that every generated request is cheap), fuzzes it and stops it (`make fuzz`); the test suite
runs a bounded fuzz through `fuzz()` against a tiny model.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
)
# Small enough that any request a generator makes is served in a moment.
SERVER_FLAGS = ("--context-length", "64", "--max-request-sequences", "8")


def fuzz(url: str, examples: int, seed: int = 0) -> tuple[int, str, dict[str, int]]:
    """Run the schemathesis CLI against `url` with `examples` cases per operation, positive
    and negative (the coverage phase, which ignores the bound, is left out). Returns its exit
    code, its output and the counts of its summary (generated, passed, failures...)."""
    with tempfile.TemporaryDirectory() as scratch:
        run = subprocess.run(
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "run",
                f"{url}/openapi.json",
                "--max-examples",
                str(examples),
                "--mode",
                "all",
                "--phases",
                "examples,fuzzing",
                "--checks",
                ",".join(CHECKS),
                "--workers",
                "1",
                "--seed",
                str(seed),
                "--request-timeout",
                "60",
                "--no-color",
            ],
            cwd=scratch,  # its caches and replay files go there
            capture_output=True,
            text=True,
        )
    output = run.stdout + run.stderr
    counts = {
        name: int(n)
        for n, name in re.findall(r"(\d+) (generated|passed|skipped|failures?|errors?)", output)
    }
    return run.returncode, output, counts


def main() -> None:
    from tests.server_utils import start_server, stop_server

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=200, help="cases per operation")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    proc, url = start_server(*SERVER_FLAGS, "--dtype", "float32")
    try:
        code, output, counts = fuzz(url, ns.examples, ns.seed)
    finally:
        stop_server(proc)
    print(output)
    print(f"schemathesis: {counts}")
    sys.exit(code)


if __name__ == "__main__":
    main()
