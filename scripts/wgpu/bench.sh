#!/usr/bin/env bash
# Runs on the GPU host (from the repository root; .gl and .device/wgpu.tar.xz carried, made by
# scripts/wgpu/bundle.sh): ferrite's wgpu backend on Vulkan, `ferrite bench offline` on the
# Llama-3.2-1B and Llama-3.1-8B shapes with random weights. Parts, as arguments:
#   profile   the 8B shape again with FERRITE_WGPU_PROFILE=1 (GPU time by kernel, in $OUT/*.err)
#   llamacpp  llama.cpp's Vulkan llama-bench on random Q4_0 GGUFs of the same shapes
#             (bin/llama-bench and bin/random_gguf in the bundle) beside ferrite on those files
set -uo pipefail
out=${OUT:-/tmp/ferrite-out}
mkdir -p "$out" /tmp/ferrite
# shellcheck disable=SC1091
source scripts/wgpu/vulkan-env.sh
xz -dc .device/wgpu.tar.xz | tar -C /tmp/ferrite -xf -
bin=/tmp/ferrite/bin
export LD_LIBRARY_PATH=$bin
parts=" $* "
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# SHAPES: the configs to run (default both).
read -ra shapes <<< "${SHAPES:-scripts/wgpu/llama-3.2-1b.json scripts/cuda/llama-3.1-8b.json}"
offline() { # LABEL MODEL [FLAGS...]
  local label=$1 model=$2
  shift 2
  echo "## $label"
  timeout 300 "$bin/ferrite" bench offline "$model" --device vulkan --max-model-len 4096 \
    --prompt-tokens 512 --gen-tokens 64 "$@" 2>"$out/$label.err" | grep "|"
  grep -E "vulkan:|plan|rror" "$out/$label.err" | head -5
}
for s in "${shapes[@]}"; do
  name=$(basename "$s" .json)
  offline "$name" "$s" --load-format dummy --batch 1,8
done
# GPU time by kernel, on the 8B shape.
[[ $parts == *" profile "* ]] &&
  FERRITE_WGPU_PROFILE=1 offline llama-3.1-8b-profile scripts/cuda/llama-3.1-8b.json \
    --load-format dummy --batch 1
if [[ $parts == *" llamacpp "* ]]; then
  tok=$(ls /tmp/ferrite/models/*.gguf | head -1)
  for s in "${shapes[@]}"; do
    name=$(basename "$s" .json)
    gguf=/tmp/$name-q4_0.gguf
    [ -f "$gguf" ] || "$bin/random_gguf" "$tok" "$s" "$gguf" q4_0 > "$out/$name-gguf.log" 2>&1
    echo "## llama.cpp Vulkan, $name Q4_0"
    timeout 300 "$bin/llama-bench" -m "$gguf" -ngl 99 -fa 1 -p 512 -n 64 -r 2 2>&1 | grep "|"
    offline "$name-q4_0" "$gguf" --batch 1
  done
fi
