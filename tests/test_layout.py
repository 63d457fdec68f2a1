"""The code's shape: the layering contracts in pyproject.toml (import-linter: layers from the
entry points down to the kernels and nouns, `lang` apart from the runtime, serving without
training, speculation's scheduler side apart from its worker side, no import cycles at any
level, type-only and function-local imports included), and modules, functions and C++ files
short enough to read in one sitting."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 400


def test_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint is not None, "import-linter is missing (the dev extra installs it)"
    run = subprocess.run(
        [lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "6 kept, 0 broken" in run.stdout


def test_no_module_is_longer_than_a_sitting():
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "spectral").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


MAX_FUNCTION_LINES = 80
MAX_CPP_LINES = 600


def test_no_function_is_longer_than_a_screenful():
    import ast

    long = {}
    for path in (ROOT / "spectral").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert long == {}


def test_no_cpp_file_is_longer_than_a_sitting():
    long = {
        str(path.relative_to(ROOT)): n
        for pattern in ("*.cpp", "*.h")
        for path in (ROOT / "spectral" / "kernels").rglob(pattern)
        if (n := len(path.read_text().splitlines())) > MAX_CPP_LINES
    }
    assert long == {}


def test_every_server_argument_is_a_flag_with_help_in_one_group():
    import argparse
    from dataclasses import fields

    from spectral.args import ServerArgs
    from spectral.args.help import HELP

    grouped = [name for helps in HELP.values() for name in helps]
    assert sorted(grouped) == sorted(f.name for f in fields(ServerArgs))
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--cuda-graph-bs", "1", "2", "4", "--disable-cuda-graph"])
    args = ServerArgs.from_cli_args(ns)
    assert args.cuda_graph_bs == [1, 2, 4] and args.disable_cuda_graph
    assert args == ServerArgs(cuda_graph_bs=[1, 2, 4], disable_cuda_graph=True)
    usage = parser.format_help()  # `spectral serve --help` (a % in a help text broke it)
    assert "within 1%," in " ".join(usage.split())
    assert all(f"--{f.name.replace('_', '-')}" in usage for f in fields(ServerArgs))
