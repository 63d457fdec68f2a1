"""Peak and resident memory of serving a model: a fresh process builds an Engine, generates a
few tokens, and reports its VmHWM (peak) and VmRSS from /proc/self/status (KV pages no request
touched do not count). One process per quantization given, so no run inherits another's peak.

    python bench/memory.py --model qwen2.5-coder-1.5b                   # the integer path
    python bench/memory.py --model qwen2.5-coder-1.5b --quantization gguf,gguf-int8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import model_file  # noqa: E402

CHILD = """
import json, sys
from spectral import Engine
model, quantization, slots = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = Engine(model_path=model, quantization=quantization, max_total_tokens=slots,
                max_running_requests=1)
engine.generate("def fibonacci(n):", {"max_new_tokens": 16, "temperature": 0})
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("RESULT " + json.dumps({k: int(status[k].split()[0]) // 1024 for k in ("VmHWM", "VmRSS")}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a kit model or a path")
    ap.add_argument("--quantization", default="gguf-int8", help="comma-separated")
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    args = ap.parse_args()
    path = args.model if Path(args.model).exists() else str(model_file(args.model))
    for quantization in args.quantization.split(","):
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, path, quantization, str(args.max_total_tokens)],
            capture_output=True,
            text=True,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{quantization}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
            continue
        mib = json.loads(lines[-1][len("RESULT ") :])
        print(
            f"{Path(path).name} {quantization}: peak {mib['VmHWM']} MiB, "
            f"resident {mib['VmRSS']} MiB after 16 tokens"
        )


if __name__ == "__main__":
    main()
