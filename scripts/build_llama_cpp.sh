#!/usr/bin/env bash
# Builds llama.cpp's test-backend-ops and llama-bench with ggml's CUDA backend for sm_90 from
# the sources scripts/pack_llama_cpp.sh packed, into BUILD_DIR (gpu_bench.sh's llamacpp stage):
#   bash scripts/build_llama_cpp.sh .whl/llama.cpp-src.tgz .llama-build
# A build cut short (LLAMA_BUILD_TIMEOUT s, 540) goes on where it stopped when run again on the
# same BUILD_DIR. Where the CUDA toolkit has no cuBLAS, the cuBLAS of pip's nvidia packages (the
# one torch uses) is linked, from BUILD_DIR/cublas-lib, which the binaries' run path names.
# With flash attention's CUDA kernels (llama-bench runs with -fa 1, as users run it: about a third
# of the build). LLAMA_TARGETS names more targets (e.g. llama-server).
# LLAMA_CMAKE_FLAGS is added to cmake's configure arguments.
set -uo pipefail
src=${1:?"usage: scripts/build_llama_cpp.sh SRC.tgz BUILD_DIR"}
lb=${2:?"usage: scripts/build_llama_cpp.sh SRC.tgz BUILD_DIR"}
t0=$(date +%s)
if [[ ! -f $lb/Makefile ]]; then
  rm -rf "$lb" && mkdir -p "$lb" && tar xzf "$src" -C "$lb" || exit 2
  cublas=()
  nvcc=$(command -v nvcc) || { echo "build_llama_cpp: no nvcc on PATH" >&2; exit 2; }
  if [[ ! -f $(dirname "$(readlink -f "$nvcc")")/../include/cublas_v2.h ]]; then
    cb=$(python3 -c 'import glob, site
found = [p for s in site.getsitepackages() for p in sorted(glob.glob(s + "/nvidia/*/include/cublas_v2.h"))]
print(found[0].rsplit("/include/", 1)[0] if found else "")')
    [[ -n $cb ]] || { echo "build_llama_cpp: no cuBLAS in the CUDA toolkit or pip's nvidia packages" >&2; exit 2; }
    echo "cuBLAS from $cb"
    mkdir -p "$lb/cublas-lib"
    for f in "$cb"/lib/libcublas*.so.*; do  # (and the unversioned name, to link against)
      ln -sf "$f" "$lb/cublas-lib/"
      ln -sf "$f" "$lb/cublas-lib/$(basename "${f%%.so.*}").so"
    done
    cublas=(-DCMAKE_LIBRARY_PATH="$lb/cublas-lib" -DCMAKE_CUDA_FLAGS="-I$cb/include"
            -DCMAKE_CXX_FLAGS="-I$cb/include")
  fi
  # shellcheck disable=SC2086
  cmake -S "$lb/llama.cpp" -B "$lb" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=ON -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_NUMBER=0 "${cublas[@]}" \
    ${LLAMA_CMAKE_FLAGS:-} || { rm -f "$lb/Makefile"; exit 2; }
fi
timeout "${LLAMA_BUILD_TIMEOUT:-540}" cmake --build "$lb" -j "${LLAMA_JOBS:-$(nproc)}" \
  --target test-backend-ops llama-bench ${LLAMA_TARGETS:-}
rc=$?
echo "llama.cpp built (rc $rc) in $(( $(date +%s) - t0 )) s: $(cat "$lb/llama.cpp/SOURCE.txt")"
exit $rc
