#!/usr/bin/env bash
# The one command a lent GPU runs (device tool: carry .gpu-kit, timeout 540 s):
#
#   bash bench/gpu_check.sh             # install the kit, tests/gpu, then bench/gpu.py
#   bash bench/gpu_check.sh --dry-run   # here, on a CPU: the same steps, GPU work skipped
#
# Everything ends inside GPU_CHECK_BUDGET seconds (default 480, well before the call's limit);
# the log, the tests' JUnit XML and the bench JSON land in $OUT (default bench/out/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
OUT="${OUT:-$PWD/bench/out/gpu-check}"
BUDGET="${GPU_CHECK_BUDGET:-480}"
PY="${PYTHON:-python3}"
KIT="${GPU_KIT:-.gpu-kit}"
SITE="${GPU_KIT_SITE:-/tmp/spectral-gpu-site}"
mkdir -p "$OUT"
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

# The bench needs about 200 s (two shapes x three backends, each FlashInfer head dim a JIT
# build of ~30 s); the tests get what is left before that.
BENCH_RESERVE="${GPU_BENCH_RESERVE:-200}"
step "tests/gpu"
if ((DRY_RUN)); then
  "$PY" -m pytest -q -p no:cacheprovider --collect-only tests/gpu || status=1
else
  timeout --signal=INT "$(within "$BENCH_RESERVE")" \
    "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --timeout 150 \
    --junitxml "$OUT/gpu_tests.xml" tests/gpu || status=1
fi

step "bench/gpu.py"
if ((DRY_RUN)); then
  "$PY" bench/gpu.py --device cpu --shapes tiny --backends torch --dtype float32 \
    --batches 1,2 --prompt-len 16 --max-new-tokens 8 --out "$OUT/gpu_bench.json" || status=1
else
  timeout --signal=INT "$(within 10)" \
    "$PY" bench/gpu.py --out "$OUT/gpu_bench.json" || status=1
fi

step "done, status $status"
exit $status
