#!/usr/bin/env bash
# Builds llama.cpp's llama-quantize, llama-imatrix, llama-perplexity and llama-bench for the CPU
# (the tools that make and check the demo model's packs, and the CPU side of
# scripts/llama_side_by_side.py) from a llama-cpp-python sdist's vendor/llama.cpp:
#   .venv/bin/pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/lcp
#   bash scripts/build_llama_tools.sh /tmp/lcp/llama_cpp_python-0.3.36.tar.gz .llama-build/cpu
# The binaries land in BUILD_DIR/bin.
set -euo pipefail
sdist=${1:?"usage: scripts/build_llama_tools.sh llama_cpp_python-X.tar.gz BUILD_DIR"}
lb=${2:?"usage: scripts/build_llama_tools.sh llama_cpp_python-X.tar.gz BUILD_DIR"}
t0=$(date +%s)
if [[ ! -f $lb/CMakeCache.txt ]]; then
  mkdir -p "$lb/src"
  tar xzf "$sdist" -C "$lb/src" --strip-components=1 --wildcards '*/vendor/llama.cpp/*'
  cmake -S "$lb/src/vendor/llama.cpp" -B "$lb" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_NUMBER=0 >/dev/null
fi
cmake --build "$lb" -j "$(nproc)" --target llama-quantize llama-imatrix llama-perplexity llama-bench
echo "llama.cpp tools built in $(( $(date +%s) - t0 )) s from $(basename "$sdist")"
