#!/usr/bin/env bash
# Runs on the GPU host (from the repository root, .device/bin.tar.xz and .whl carried, the models unpacked as scripts/cuda/bundle.sh says; .whl
# from scripts/cuda/peer-wheels.sh): the
# agent `full` split served over HTTP, closed loop at C = 1, 2, 4, 8, 16, by ferrite and by
# Hugging Face transformers' server with continuous batching, on the same Llama-3.1-8B-shaped
# folder with random bf16 weights and SmolLM2's tokenizer (models/llama-8b-shape in the bundle).
# Each level draws its own prompts (--fresh-prompts); a shared system prompt and tool schemas
# stay cacheable, as in real agent traffic. Arguments pick the parts: `peer` (transformers and
# ferrite on the same PEER_PROMPTS prompts per level, default 20), `full` (ferrite, 100),
# `llamacpp-build` (builds llama.cpp's server for CUDA there from .peer/llama.cpp.tar.xz, which
# scripts/cuda/peer-llamacpp-src.sh packs, and
# writes its GGUF: the same shape and tokenizer, random F16 weights; ~6 min on 16 cores) and
# `llamacpp` (llama.cpp's server, then ferrite, on the same PEER_PROMPTS prompts, both told to
# ignore EOS so that random weights give every request its 70 tokens), `session` (one agent
# session replayed turn by turn at concurrency 1 against ferrite with prefix caching on and off).
set -uo pipefail
out=${OUT:-/tmp/ferrite-out}
mkdir -p "$out" /tmp/ferrite
for a in .device/*.tar.xz; do [ -f "$a" ] && xz -dc "$a" | tar -C /tmp/ferrite -xf -; done
ferrite=/tmp/ferrite/bin/ferrite
model=/tmp/ferrite/models/llama-8b-shape
tok=/tmp/ferrite/models/smollm2-10l.gguf
peer_prompts=${PEER_PROMPTS:-20}
wait_up() {
  for _ in $(seq 240); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 0.5; done
  return 1
}
parts=" $* "
ignore_eos=()
[[ $parts == *" llamacpp "* ]] && ignore_eos=(--ignore-eos)
bench() { # LABEL URL NUM_PROMPTS OUT_NAME
  "$ferrite" bench serve --base-url "$2/v1" --model-name "$model" --tokenizer "$tok" \
    --dataset agent --preset full --num-prompts "$3" --fresh-prompts --label "$1" --out "$out/$4.json" \
    --charts-dir "$out/charts-$4" "${ignore_eos[@]}" 2>&1 | grep -v "^\s*$" | tee "$out/$4.txt"
}
llama=/tmp/llama
ferrite_part() {
  "$ferrite" serve "$model" --device cuda --load-format dummy --max-model-len 16384 \
    --max-num-batched-tokens 8192 --served-model-name "$model" --port 8021 > "$out/ferrite-serve.log" 2>&1 &
  local pid=$!
  if wait_up http://127.0.0.1:8021; then
    [[ $parts == *" peer "* || $parts == *" llamacpp "* ]] &&
      bench ferrite http://127.0.0.1:8021 "$peer_prompts" ferrite-peer-prompts
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
llamacpp_build() {
  mkdir -p $llama
  xz -dc .peer/llama.cpp.tar.xz | tar -C $llama -xf -
  "$ferrite_dir/bin/random_gguf" "$tok" scripts/cuda/llama-3.1-8b.json $llama/model.gguf \
    > "$out/llamacpp-gguf.log" 2>&1 &
  local gguf=$!
  cmake -S $llama/llama.cpp -B $llama/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF > "$out/llamacpp-build.log" 2>&1 &&
    cmake --build $llama/build -j "$(nproc)" --target llama-server >> "$out/llamacpp-build.log" 2>&1
  echo "llama.cpp build: exit $?"; tail -3 "$out/llamacpp-build.log"
  wait $gguf; cat "$out/llamacpp-gguf.log"
}
llamacpp_part() {
  [ -x $llama/build/bin/llama-server ] || { echo "llama.cpp not built"; return; }
  # Slots for the highest concurrency, each with room for the longest agent prompt + output.
  $llama/build/bin/llama-server -m $llama/model.gguf -ngl 99 -fa on --parallel 16 -c 262144 \
    --port 8023 > "$out/llamacpp-serve.log" 2>&1 &
  local pid=$!
  if wait_up http://127.0.0.1:8023; then
    bench "llama.cpp $(cd $llama/llama.cpp && git describe 2>/dev/null || echo 11434) server, CUDA" \
      http://127.0.0.1:8023 "$peer_prompts" llamacpp-peer-prompts
  else
    echo "llama-server did not come up"
  fi
  grep -i "error\|CUDA\|flash\|n_ctx\|slots" "$out/llamacpp-serve.log" | head -20
  kill $pid; wait $pid 2>/dev/null
}
session_part() {
  for mode in on off; do
    local flags=()
    [ $mode = off ] && flags=(--no-enable-prefix-caching)
    "$ferrite" serve "$model" --device cuda --load-format dummy --max-model-len 16384 \
      --served-model-name "$model" --port 8031 "${flags[@]}" > "$out/session-$mode-serve.log" 2>&1 &
    local pid=$!
    wait_up http://127.0.0.1:8031 || tail -20 "$out/session-$mode-serve.log"
    "$ferrite" bench serve --base-url http://127.0.0.1:8031/v1 --model-name "$model" --tokenizer "$tok" \
      --dataset session --num-prompts 14 --max-tokens 16 --ignore-eos --concurrency 1 --warmup 0 \
      --label "ferrite, prefix caching $mode" --out "$out/session-$mode.json" \
      --charts-dir "$out/charts-session-$mode" 2>&1 | grep -v "^\s*$" | tail -4
    kill $pid; wait $pid 2>/dev/null
  done
}
ferrite_dir=/tmp/ferrite
[[ $parts == *" session "* ]] && { session_part; exit; }
[[ $parts == *" llamacpp-build "* ]] && { llamacpp_build; exit; }
[[ $parts == *" llamacpp "* ]] && llamacpp_part
[[ $parts == *" peer "* ]] && peer_part
ferrite_part
