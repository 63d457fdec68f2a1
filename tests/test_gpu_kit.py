"""The GPU kit (the wheels a lent GPU machine needs beside its image) is complete and under its
cap, and bench/gpu_check.sh, the one command that machine runs, goes through every step here on
the CPU (--dry-run: the kit resolved for cp312, tests/gpu collected, bench/gpu.py's logic on a
tiny model)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_kit import KIT_DIR, MAX_BYTES, check

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kit() -> Path:
    """The kit, downloaded once per machine (make gpu-kit) from the package registry."""
    subprocess.run([sys.executable, "bench/gpu_kit.py"], cwd=ROOT, check=True)
    return KIT_DIR


def test_the_kit_is_complete_and_under_its_cap(kit):
    assert check(kit) == []
    wheels = list(kit.glob("*.whl"))
    assert sum(w.stat().st_size for w in wheels) <= MAX_BYTES
    names = {w.name.split("-")[0] for w in wheels}
    assert {"pyzmq", "fastapi", "uvicorn", "orjson", "pydantic", "gguf", "xgrammar"} <= names
    assert "flashinfer_python" in names


def test_a_kit_missing_a_dependency_is_refused_naming_it(kit, tmp_path):
    for wheel in kit.glob("*.whl"):
        if not wheel.name.startswith("pydantic_core"):
            shutil.copy(wheel, tmp_path)
    problems = check(tmp_path)
    assert "pydantic-core==2.50.5 is missing; run: make gpu-kit" in problems
    assert any(
        "needs pydantic-core==2.50.5, which neither the kit nor the image" in p for p in problems
    )


def test_the_gpu_check_runs_every_step_dry(kit, tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path),
        "GPU_KIT_SITE": str(tmp_path / "site"),
    }
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "gpu_check.log").read_text()
    for step in ("== kit", "== device", "== tests/gpu", "== bench/gpu.py", "== done, status 0"):
        assert step in log
    assert "the kit's wheels install for cp312 manylinux x86_64" in log
    assert re.search(r"\n\d+ tests collected", log)
    bench = json.loads((tmp_path / "gpu_bench.json").read_text())
    [run] = bench["runs"]
    assert (run["shape"], run["backend"]) == ("tiny", "torch")
    assert set(run["plain_tok_s"]) == {"1", "2"} and all(v > 0 for v in run["plain_tok_s"].values())
    assert list(run["verify_ms"])[0] == "1" and list(run["verify_ms"])[-1] == "64"
