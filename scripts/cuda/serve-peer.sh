#!/usr/bin/env bash
# Runs on the GPU host (from the repository root, .device/bundle.tar.xz and .whl carried; .whl
# from scripts/cuda/peer-wheels.sh): the
# agent `full` split served over HTTP, closed loop at C = 1, 2, 4, 8, 16, by ferrite and by
# Hugging Face transformers' server with continuous batching, on the same Llama-3.1-8B-shaped
# folder with random bf16 weights and SmolLM2's tokenizer (models/llama-8b-shape in the bundle).
# Each level draws its own prompts (--fresh-prompts); a shared system prompt and tool schemas
# stay cacheable, as in real agent traffic. Arguments pick the parts: `peer` (transformers and
# ferrite on the same PEER_PROMPTS prompts per level, default 20), `full` (ferrite, 100).
set -uo pipefail
out=${OUT:-/tmp/ferrite-out}
mkdir -p "$out" /tmp/ferrite
[ -x /tmp/ferrite/bin/ferrite ] || xz -dc .device/bundle.tar.xz | tar -C /tmp/ferrite -xf -
ferrite=/tmp/ferrite/bin/ferrite
model=/tmp/ferrite/models/llama-8b-shape
tok=/tmp/ferrite/models/smollm2-10l.gguf
peer_prompts=${PEER_PROMPTS:-20}
wait_up() {
  for _ in $(seq 240); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 0.5; done
  return 1
}
bench() { # LABEL URL NUM_PROMPTS OUT_NAME
  "$ferrite" bench serve --base-url "$2/v1" --model-name "$model" --tokenizer "$tok" \
    --dataset agent --preset full --num-prompts "$3" --fresh-prompts --label "$1" --out "$out/$4.json" \
    --charts-dir "$out/charts-$4" 2>&1 | grep -v "^\s*$" | tee "$out/$4.txt"
}
parts=" $* "
ferrite_part() {
  "$ferrite" serve "$model" --device cuda --load-format dummy --max-model-len 16384 \
    --max-num-batched-tokens 8192 --served-model-name "$model" --port 8021 > "$out/ferrite-serve.log" 2>&1 &
  local pid=$!
  if wait_up http://127.0.0.1:8021; then
    [[ $parts == *" peer "* ]] && bench ferrite http://127.0.0.1:8021 "$peer_prompts" ferrite-peer-prompts
    [[ $parts == *" full "* ]] && bench ferrite http://127.0.0.1:8021 100 ferrite-full
  else
    tail -20 "$out/ferrite-serve.log"
  fi
  kill $pid; wait $pid 2>/dev/null
}
peer_part() {
  rm -rf /tmp/site  # a stale package left there by an earlier call would shadow the image's
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  PYTHONUNBUFFERED=1 python3 scripts/cuda/transformers_serve.py "$model" 8022 \
    > "$out/transformers-serve.log" 2>&1 &
  local pid=$!
  if wait_up http://127.0.0.1:8022; then
    # One request loads the model before the clock starts (the server loads on first use).
    curl -s -m 600 http://127.0.0.1:8022/v1/chat/completions -H 'content-type: application/json' \
      -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 4}" \
      | head -c 600; echo
    bench "transformers $(python3 -c 'import transformers; print(transformers.__version__)') serve --continuous-batching" \
      http://127.0.0.1:8022 "$peer_prompts" transformers-peer-prompts
  else
    echo "transformers serve did not come up"
  fi
  tail -30 "$out/transformers-serve.log"
  kill $pid; wait $pid 2>/dev/null
}
[[ $parts == *" peer "* ]] && peer_part
ferrite_part
