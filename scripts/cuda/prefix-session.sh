#!/usr/bin/env bash
# Runs on the GPU host (from the repository root, .device/bundle.tar.xz carried): one agent
# session replayed turn by turn (each turn = the previous history + a tool call and its result,
# concurrency 1) against ferrite serving the Llama-3.1-8B-shaped folder of the bundle with random
# weights, with prefix caching (the default) and without. Results in $OUT.
set -uo pipefail
out=${OUT:-/tmp/ferrite-out}
mkdir -p "$out" /tmp/ferrite
[ -x /tmp/ferrite/bin/ferrite ] || xz -dc .device/bundle.tar.xz | tar -C /tmp/ferrite -xf -
ferrite=/tmp/ferrite/bin/ferrite
model=/tmp/ferrite/models/llama-8b-shape
tok=/tmp/ferrite/models/smollm2-10l.gguf
for mode in on off; do
  flags=()
  [ $mode = off ] && flags=(--no-enable-prefix-caching)
  "$ferrite" serve "$model" --device cuda --load-format dummy --max-model-len 16384 \
    --served-model-name "$model" --port 8031 "${flags[@]}" > "$out/session-$mode-serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do curl -sf http://127.0.0.1:8031/health >/dev/null 2>&1 && break; sleep 0.5; done
  "$ferrite" bench serve --base-url http://127.0.0.1:8031/v1 --model-name "$model" --tokenizer "$tok" \
    --dataset session --num-prompts 14 --max-tokens 16 --ignore-eos --concurrency 1 --warmup 0 \
    --label "ferrite, prefix caching $mode" --out "$out/session-$mode.json" \
    --charts-dir "$out/charts-session-$mode" 2>&1 | grep -v "^\s*$" | tail -4
  kill $pid; wait $pid 2>/dev/null
done
