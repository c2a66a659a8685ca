#!/usr/bin/env bash
# Runs on the GPU host (from the repository root; .gl and .device/wgpu.tar.xz carried, made by
# scripts/wgpu/bundle.sh): ferrite's wgpu backend on Vulkan, `ferrite bench offline` on the
# Llama-3.2-1B and Llama-3.1-8B shapes with random weights. Parts, as arguments:
#   profile   the 8B shape again with FERRITE_WGPU_PROFILE=1 (GPU time by kernel, in $OUT/*.err)
#   llamacpp  llama.cpp's Vulkan llama-bench on random GGUFs (GGUFS: SmolLM2-135M's shape in
#             Q4_1, the 1B and 8B shapes in Q4_0; bin/llama-bench and bin/random_gguf in the
#             bundle) beside ferrite on those files
#   ablate    on the 8B shape's Q4_0 GGUF (the llamacpp part makes it), decode at batch 1:
#             the profile, then each kernel of SKIPS left out (FERRITE_WGPU_SKIP: what it
#             costs unprofiled), then the matrix-vector kernel at each shape of GEMVS
#             (FERRITE_WGPU_GEMV=R,ROWS)
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
# GGUFS: CONFIG:FORMAT pairs for the llama.cpp part (random blocks of that shape and format).
ggufs=${GGUFS:-"scripts/wgpu/smollm2-135m.json:q4_1 scripts/wgpu/llama-3.2-1b.json:q4_0 scripts/cuda/llama-3.1-8b.json:q4_0"}
if [[ $parts == *" llamacpp "* ]]; then
  tok=$(ls /tmp/ferrite/models/*.gguf | head -1)
  for g in $ggufs; do
    s=${g%:*} fmt=${g#*:}
    name=$(basename "$s" .json)-$fmt
    gguf=/tmp/$name.gguf
    [ -f "$gguf" ] || "$bin/random_gguf" "$tok" "$s" "$gguf" "$fmt" > "$out/$name-gguf.log" 2>&1
    echo "## llama.cpp Vulkan, $name"
    timeout 300 "$bin/llama-bench" -m "$gguf" -ngl 99 -fa 1 -p 512 -n 64 -r 2 2>&1 | grep "|"
    offline "$name" "$gguf" --batch 1,8
  done
fi
if [[ $parts == *" ablate "* ]]; then
  gguf=/tmp/llama-3.1-8b-q4_0.gguf
  decode() { # LABEL
    echo "## $1"
    timeout 300 "$bin/ferrite" bench offline "$gguf" --device vulkan --max-model-len 4096 \
      --prompt-tokens 512 --gen-tokens 128 --batch 1 2>"$out/$1.err" | grep "|"
  }
  FERRITE_WGPU_PROFILE=1 decode ablate-profile
  decode ablate-none
  for k in ${SKIPS:-"attention,attention_combine attention_combine qkv gemv rms_norm"}; do
    FERRITE_WGPU_SKIP=$k decode "ablate-skip-$k"
  done
  for g in ${GEMVS:-"2,4 4,8 1,2 2,8 4,16 1,4"}; do
    FERRITE_WGPU_GEMV=$g decode "ablate-gemv-$g"
  done
fi
