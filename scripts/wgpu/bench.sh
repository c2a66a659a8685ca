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
#   serve     the agent `full` split served over HTTP at C = 1, 4, 16 (PEER_PROMPTS prompts a
#             level, default 16, fresh each level, EOS ignored and banned) by llama.cpp's
#             Vulkan llama-server, then by `ferrite serve --device vulkan`, on that GGUF
set -uo pipefail
out=${OUT:-/tmp/ferrite-out}
mkdir -p "$out" /tmp/ferrite
# shellcheck disable=SC1091
source scripts/wgpu/vulkan-env.sh
xz -dc .device/wgpu.tar.xz | tar -C /tmp/ferrite -xf -
[ -f .device/llama-server.tar.xz ] && xz -dc .device/llama-server.tar.xz | tar -C /tmp/ferrite -xf -
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
if [[ $parts == *" serve "* ]]; then
  gguf=/tmp/llama-3.1-8b-q4_0.gguf
  tok=$(ls /tmp/ferrite/models/*.gguf | head -1)
  [ -f "$gguf" ] || "$bin/random_gguf" "$tok" scripts/cuda/llama-3.1-8b.json "$gguf" q4_0 > "$out/gguf.log" 2>&1
  up() { for _ in $(seq 240); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 0.5; done; return 1; }
  agent() { # LABEL PORT NAME
    "$bin/ferrite" bench serve --base-url "http://127.0.0.1:$2/v1" --model-name "$gguf" --tokenizer "$tok" \
      --dataset agent --preset full --num-prompts "${PEER_PROMPTS:-16}" --fresh-prompts --concurrency 1,4,16 \
      --ignore-eos --ban-eos --label "$1" --out "$out/$3.json" 2>&1 | grep -v "^\s*$" | tail -12
  }
  # Slots for the highest concurrency, each with room for the longest agent prompt + output.
  "$bin/llama-server" -m "$gguf" -ngl 99 -fa on --parallel 16 -c 262144 --port 8023 \
    > "$out/llamacpp-serve.log" 2>&1 &
  pid=$!
  if up http://127.0.0.1:8023; then agent "llama.cpp server, Vulkan" 8023 serve-llamacpp
  else tail -5 "$out/llamacpp-serve.log"; fi
  kill $pid; wait $pid 2>/dev/null
  "$bin/ferrite" serve "$gguf" --device vulkan --max-model-len 16384 --served-model-name "$gguf" \
    --port 8021 > "$out/ferrite-serve.log" 2>&1 &
  pid=$!
  if up http://127.0.0.1:8021; then agent "ferrite, Vulkan" 8021 serve-ferrite
  else tail -5 "$out/ferrite-serve.log"; fi
  kill $pid; wait $pid 2>/dev/null
fi
