#!/usr/bin/env bash
# Runs on the GPU host (from the repository root, .device/bin.tar.xz carried, the models unpacked by an earlier call: scripts/cuda/bundle.sh): ferrite and
# Hugging Face transformers' continuous batching on the same burst of requests shaped like the
# agent `full` split (100 prompts, mean 4.6K input tokens, 70 output tokens, greedy), same
# Llama-3.1-8B-shaped config with random bf16 weights, one after the other.
set -euo pipefail
out=${OUT:-/tmp/ferrite-out}
mkdir -p "$out" /tmp/ferrite
for a in .device/*.tar.xz; do [ -f "$a" ] && xz -dc "$a" | tar -C /tmp/ferrite -xf -; done
config=scripts/cuda/llama-3.1-8b.json
flags=(--device cuda --load-format dummy --max-model-len 8192 --max-num-batched-tokens 8192)
/tmp/ferrite/bin/ferrite bench throughput "$config" "${flags[@]}" --dump-prompts /tmp/prompts.json
/tmp/ferrite/bin/ferrite bench throughput "$config" "${flags[@]}" 2>"$out/ferrite-throughput.err" \
  | tee "$out/throughput.md"
PYTHONUNBUFFERED=1 timeout 300 python3 scripts/cuda/transformers_peer.py "$config" /tmp/prompts.json 70 \
  2>"$out/transformers.err" | tee -a "$out/throughput.md" || tail -20 "$out/transformers.err"
