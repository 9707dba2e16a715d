#!/usr/bin/env bash
# Builds llama.cpp's own benchmark tools (llama-bench, test-backend-ops) from the llama.cpp source that the
# llama-cpp-python source distribution vendors, into a cache folder outside the repository. A benchmark set-up
# step (bench_mcf.py and bench_llm.py read the result), never run in CI: the build takes minutes.
#
#   bash bench/setup_llamacpp.sh            # builds into ${CARTON_BENCH_CACHE:-~/.cache/carton-bench}/llama.cpp
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 bash bench/setup_llamacpp.sh
#
# Build flags: Release, GGML_NATIVE=ON (the build machine's own CPU features) less AMX, OpenMP on, no BLAS, no CURL;
# llama.cpp's thread count is chosen per run (llama-bench -t).
set -euo pipefail
cache="${CARTON_BENCH_CACHE:-$HOME/.cache/carton-bench}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
jobs="${BUILD_JOBS:-2}"
src="$cache/llama_cpp_python-$version"
build="$cache/llama.cpp-$version-build"
mkdir -p "$cache"
# ggml's AMX matrix path (compiled in when the build machine's CPU reports AMX-INT8) crashed in its first product
# of this model's 4-bit type; without it the build keeps every AVX-512 / VNNI kernel and its repacked layouts.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [[ ! -d "$src" ]]; then
    python -m pip download --no-deps --no-binary :all: --dest "$cache" "llama-cpp-python==$version"
    tar -xzf "$cache/llama_cpp_python-$version.tar.gz" -C "$cache"
fi
cmake -S "$src/vendor/llama.cpp" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
    -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$build" -j "$jobs" --target llama-bench test-backend-ops
ln -sfn "$build/bin" "$cache/llama.cpp"
echo "built: $cache/llama.cpp/llama-bench $cache/llama.cpp/test-backend-ops"
