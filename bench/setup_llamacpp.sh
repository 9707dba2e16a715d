#!/usr/bin/env bash
# Builds llama.cpp's own benchmark tools (llama-bench, test-backend-ops) from the llama.cpp source that the
# llama-cpp-python source distribution vendors, into a cache folder outside the repository, and a second, shared
# build of ggml alone with the same flags (libggml.so and its backends, which bench/_ggml.py loads so that
# bench_mcf.py times ggml's product in its own process). A benchmark set-up step (bench_mcf.py and bench_llm.py
# read the result), never run in CI: the build takes minutes.
#
#   bash bench/setup_llamacpp.sh            # builds into ${CARTON_BENCH_CACHE:-~/.cache/carton-bench}/llama.cpp
#                                           # and .../ggml (the shared libraries)
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
shared="$cache/ggml-$version-shared"
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
# ggml alone (the target ggml of the same project: the vendored ggml folder lacks files its own project wants),
# shared, with the flags above: the same CPU kernels as the static libraries the tools link.
cmake -S "$src/vendor/llama.cpp" -B "$shared" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=ON
cmake --build "$shared" -j "$jobs" --target ggml
ln -sfn "$shared/bin" "$cache/ggml"
echo "built: $cache/llama.cpp/llama-bench $cache/llama.cpp/test-backend-ops $cache/ggml/libggml.so"
