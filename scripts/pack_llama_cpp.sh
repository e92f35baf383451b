#!/usr/bin/env bash
# Packs the llama.cpp sources that gpu_bench.sh's llamacpp stage builds on the GPU machine
# (ggml's CPU and CUDA backends, libllama, common, llama-bench, test-backend-ops) into
# .whl/llama.cpp-src.tgz, small enough to carry (the whole tree, with its models and docs, is
# not). The source: a llama.cpp checkout, or a llama-cpp-python sdist (its vendor/llama.cpp):
#   bash scripts/pack_llama_cpp.sh ~/src/llama.cpp
#   pip download llama-cpp-python --no-deps --no-binary :all: -d /tmp/lcp
#   bash scripts/pack_llama_cpp.sh /tmp/lcp/llama_cpp_python-*.tar.gz
# The llama.cpp commit (or the sdist's name) goes into the tarball as SOURCE.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?"usage: scripts/pack_llama_cpp.sh LLAMA_CPP_DIR | llama_cpp_python-X.tar.gz"}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [[ -f $src ]]; then
  tar xzf "$src" -C "$tmp"
  dir=$(ls -d "$tmp"/*/vendor/llama.cpp 2>/dev/null | head -1)
  [[ -n $dir ]] || { echo "$src: no vendor/llama.cpp inside: give a llama-cpp-python sdist" >&2; exit 2; }
  origin="$(basename "$src")"
elif [[ -f $src/CMakeLists.txt && -d $src/ggml/src/ggml-cuda ]]; then
  dir=$src
  origin="llama.cpp $(git -C "$src" rev-parse HEAD 2>/dev/null || echo '(commit unknown)')"
else
  echo "$src: neither a llama.cpp tree (CMakeLists.txt, ggml/src/ggml-cuda) nor an sdist" >&2
  exit 2
fi
mkdir -p .whl "$tmp/pack"
# what the build needs: the backends other than CPU and CUDA, the models, docs, examples,
# server and web UI stay out (LLAMA_BUILD_EXAMPLES / _SERVER / _APP are off in the build)
keep_backend() { [[ $1 == ggml-cpu || $1 == ggml-cuda ]]; }
excl=(--exclude=./models --exclude=./docs --exclude=./examples --exclude=./pocs --exclude=./media
      --exclude=./benches --exclude=./app --exclude=./tools/ui --exclude=./tools/server
      --exclude=./.git --exclude=./gguf-py --exclude=./conversion --exclude=./ci)
for b in "$dir"/ggml/src/ggml-*/; do
  b=$(basename "$b"); keep_backend "$b" || excl+=(--exclude="./ggml/src/$b")
done
echo "$origin" >"$tmp/pack/SOURCE.txt"
tar cf "$tmp/pack/src.tar" -C "$dir" "${excl[@]}" .
mkdir "$tmp/pack/llama.cpp" && tar xf "$tmp/pack/src.tar" -C "$tmp/pack/llama.cpp"
mv "$tmp/pack/SOURCE.txt" "$tmp/pack/llama.cpp/"
tar czf .whl/llama.cpp-src.tgz -C "$tmp/pack" llama.cpp
echo ".whl/llama.cpp-src.tgz: $(du -h .whl/llama.cpp-src.tgz | cut -f1) from $origin"
