"""The code's shape: the layering contracts in pyproject.toml (import-linter: layers from the
server down to the kernels and nouns, `lang` apart from the runtime, serving without training,
no import cycles at any level, type-only and function-local imports included) and modules
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
    assert "4 kept, 0 broken" in run.stdout


def test_no_module_is_longer_than_a_sitting():
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "spectral").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
