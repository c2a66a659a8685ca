#!/usr/bin/env bash
# Packs what scripts/wgpu/bench.sh runs on the GPU host (no network there): ferrite (its
# default build has the wgpu backend), random_gguf, a 1-layer cut of the test model (its
# tokenizer for random GGUFs) and, when LLAMA_BUILD names a llama.cpp build with
# -DGGML_VULKAN=ON (scripts/wgpu/llamacpp-build.sh), its llama-bench and llama-server with
# the OpenMP runtime they link, into .device/wgpu.tar.xz; the Vulkan loader's debs into
# .gl; llama-server into .device/llama-server.tar.xz. Carry ".gl" and the archives a call needs.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
cargo build --release -p ferrite
cargo build --release -q -p ferrite-model --example random_gguf --example cut_gguf
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/models"
cp target/release/ferrite target/release/examples/random_gguf "$stage/bin/"
if [ -n "${LLAMA_BUILD:-}" ]; then
  cp "$LLAMA_BUILD/bin/llama-bench" "$stage/bin/"
  cp "$(ldconfig -p | grep -m1 'libgomp.so.1 ' | sed 's/.*=> //')" "$stage/bin/"
fi
strip "$stage"/bin/*[!1]
model=$(scripts/fetch-model.sh smollm2)
target/release/examples/cut_gguf "$model" "$stage/models/smollm2-1l.gguf" 1 q4_0
mkdir -p .device .gl
tar -C "$stage" -cf - bin models | xz -6 -T2 > .device/wgpu.tar.xz
# llama-server apart (the serve part alone needs it): a call carries 64 MiB at most.
if [ -n "${LLAMA_BUILD:-}" ]; then
  mkdir -p "$stage/server/bin"
  strip -o "$stage/server/bin/llama-server" "$LLAMA_BUILD/bin/llama-server"
  tar -C "$stage/server" -cf - bin | xz -6 -T2 > .device/llama-server.tar.xz
fi
# The Vulkan loader and what it loads, for amd64 (the GPU host's image has neither).
o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64-lists)
mkdir -p /tmp/amd64-lists/partial
apt-get "${o[@]}" update -qq
(cd .gl && apt-get "${o[@]}" download -qq libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
ls -la .device/wgpu.tar.xz .gl
