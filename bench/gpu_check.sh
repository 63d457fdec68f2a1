#!/usr/bin/env bash
# The one command a lent GPU runs (device tool: carry .gpu-kit, timeout 540 s):
#
#   bash bench/gpu_check.sh             # install the kit, tests/gpu, then bench/gpu.py
#   bash bench/gpu_check.sh --dry-run   # here, on a CPU: the same steps, GPU work skipped
#
# Everything ends inside GPU_CHECK_BUDGET seconds (default 520, before the call's 540 s): the
# tests get what is left but GPU_BENCH_RESERVE (default 340) seconds, the bench the rest. The
# log, the tests' JUnit XML and the bench's JSON (gpu-latest.json, rewritten after each of its
# parts, so a timeout still leaves one; commit it as bench/results/gpu-latest.json) land in
# $OUT (default bench/out/gpu-check). The JSON names the commit from git, or from
# GPU_CHECK_COMMIT where the tree there has no .git (set it in the device call's command).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
OUT="${OUT:-$PWD/bench/out/gpu-check}"
BUDGET="${GPU_CHECK_BUDGET:-520}"
PY="${PYTHON:-python3}"
KIT="${GPU_KIT:-.gpu-kit}"
SITE="${GPU_KIT_SITE:-/tmp/spectral-gpu-site}"
mkdir -p "$OUT"
GPU_CHECK_COMMIT="${GPU_CHECK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}"
export GPU_CHECK_COMMIT
exec > >(tee "$OUT/gpu_check.log") 2>&1
start=$SECONDS
left() { echo $((BUDGET - (SECONDS - start))); }
within() { local n=$(($(left) - $1)); echo $((n < 1 ? 1 : n)); }  # seconds left, less a reserve
step() { echo; echo "== $* ($(left) s left)"; }
status=0

step "kit"
"$PY" bench/gpu_kit.py --check --dir "$KIT" || exit 1
PLATFORMS=()
for p in manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux2014_x86_64; do
  PLATFORMS+=(--platform "$p")
done
if ((DRY_RUN)); then
  # Resolve the wheels for the GPU image's Python (cp312) without installing anything.
  "$PY" -m pip install --quiet --dry-run --no-index --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    --target "$SITE-dry" "$KIT"/*.whl || exit 1
  echo "the kit's wheels install for cp312 manylinux x86_64"
else
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$KIT"/*.whl || exit 1
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step "device"
if ((DRY_RUN)); then
  echo "dry run: no GPU asked for"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" - <<'EOF' || exit 1
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("triton", triton.__version__)
try:
    import flashinfer
    print("flashinfer", flashinfer.__version__)
except Exception as err:  # noqa: BLE001 - reported, the bench then skips its rows
    print("flashinfer does not import:", err)
EOF
fi

# The bench's parts, most important first (bandwidth, decode at three shapes, verify, EAGLE-3
# rounds, launches a token, then transformers compiled: half of the time), need about 160-280 s
# on an H100 by estimate; it gets 340. The tests get what is left before that (about 130 s on an
# H200 so far).
BENCH_RESERVE="${GPU_BENCH_RESERVE:-340}"
step "tests/gpu"
if ((DRY_RUN)); then
  "$PY" -m pytest -q -p no:cacheprovider --collect-only tests/gpu || status=1
else
  # eight workers where pytest-xdist is there (the image has it): the FlashInfer JIT builds and
  # the host-bound engines side by side on the machine's 16 cores
  PARALLEL=()
  "$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n "${GPU_TEST_WORKERS:-8}")
  timeout --signal=INT "$(within "$BENCH_RESERVE")" \
    "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --timeout 150 "${PARALLEL[@]}" \
    --junitxml "$OUT/gpu_tests.xml" tests/gpu || status=1
fi

step "bench/gpu.py"
if ((DRY_RUN)); then
  # every part on the tiny shape, few tokens: the logic and the JSON, no meaningful figure
  "$PY" bench/gpu.py --device cpu --shapes tiny --dtype float32 --prompt-len 16 \
    --new-tokens 32 --short-tokens 4 --repeats 1 --verify-curves 1 --batches 1,16 \
    --out "$OUT/gpu-latest.json" || status=1
else
  # no part starts in the last 25 s; one still running 5 s before the end is interrupted
  # (the JSON is written as it stops)
  # GPU_BENCH_ARGS: more options, e.g. "--tau 1.92" (a projection) or "--parts ..."
  timeout -k 15 --signal=INT "$(within 5)" "$PY" bench/gpu.py --budget-s "$(within 25)" \
    --out "$OUT/gpu-latest.json" ${GPU_BENCH_ARGS:-} || status=1
fi

step "done, status $status"
exit $status
