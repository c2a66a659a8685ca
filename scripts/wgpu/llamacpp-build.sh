#!/usr/bin/env bash
# Builds llama.cpp's Vulkan backend (llama-bench, llama-server) here, from the source
# scripts/cuda/peer-llamacpp-src.sh packs (the release the CPU peer runs), for the GPU host:
#   bash scripts/wgpu/llamacpp-build.sh && LLAMA_BUILD=/tmp/llamacpp-vulkan/build bash scripts/wgpu/bundle.sh
# Debian 12's Vulkan headers are older than ggml-vulkan needs: trixie's are unpacked beside.
# ~7 minutes on 2 cores (2026-12-07).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=/tmp/llamacpp-vulkan
apt-get install -y -qq glslc glslang-tools spirv-headers libvulkan-dev cmake >/dev/null
[ -f "$root/.peer/llama.cpp.tar.xz" ] || bash "$root/scripts/cuda/peer-llamacpp-src.sh"
mkdir -p "$dir/trixie/lists/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
  > "$dir/trixie/sources.list"
o=(-oDir::Etc::SourceList="$dir/trixie/sources.list" -oDir::Etc::SourceParts=/dev/null
  -oDir::State::Lists="$dir/trixie/lists" -oAPT::Architecture=amd64)
apt-get "${o[@]}" update -qq
(cd "$dir" && apt-get "${o[@]}" download -qq libvulkan-dev && dpkg -x libvulkan-dev_*.deb "$dir/headers")
xz -dc "$root/.peer/llama.cpp.tar.xz" | tar -C "$dir" -xf -
cmake -S "$dir/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON \
  -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
  -DVulkan_INCLUDE_DIR="$dir/headers/usr/include" >/dev/null
cmake --build "$dir/build" -j "$(nproc)" --target llama-bench llama-server >/dev/null
ls -la "$dir/build/bin"
