#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with .device/bin.tar.xz carried there and
# the models unpacked into /tmp/ferrite by an earlier call (scripts/cuda/bundle.sh makes both
# archives and says how): the CUDA kernel and model tests, then the device
# benchmark and the engine's offline benchmark on a Llama-3.1-8B-shaped model with random
# weights. Logs go to $OUT (or /tmp/ferrite-out).
set -euo pipefail
out=${OUT:-/tmp/ferrite-out}
mkdir -p "$out" /tmp/ferrite
for a in .device/*.tar.xz; do xz -dc "$a" | tar -C /tmp/ferrite -xf -; done
[ -f /tmp/ferrite/models/smollm2-10l.gguf ] || { echo "models not unpacked: see scripts/cuda/bundle.sh" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
status=0
( root=$PWD && cd /tmp/ferrite && FERRITE_CUDA_TEST_MODEL=/tmp/ferrite/models/smollm2-10l.gguf \
    FERRITE_REPO_ROOT=$root ./bin/cuda-tests --test-threads 1 --nocapture "${CUDA_TESTS:-}" ) 2>&1 | tee "$out/tests.log" || status=1
/tmp/ferrite/bin/ferrite bench device scripts/cuda/llama-3.1-8b.json "$@" 2>&1 \
  | tee "$out/bench-device.log" || status=1
# HTTP serving on the GPU with the real (cut) model, its tokenizer and chat template.
/tmp/ferrite/bin/ferrite serve /tmp/ferrite/models/smollm2-10l.gguf --device cuda --port 8011 \
  > "$out/serve.log" 2>&1 &
server=$!
for _ in $(seq 120); do curl -sf localhost:8011/health >/dev/null 2>&1 && break; sleep 0.5; done
python3 scripts/cuda/serve_smoke.py http://localhost:8011 2>&1 | tee "$out/serve-smoke.log" || status=1
kill $server; wait $server 2>/dev/null || true
# The same model through the engine (loader, memory plan, scheduler, runner): tokens/s.
/tmp/ferrite/bin/ferrite bench offline --device cuda --load-format dummy \
  scripts/cuda/llama-3.1-8b.json --max-model-len 8192 --max-num-batched-tokens 8192 \
  --prompt-tokens 4608 --batch 1,8,32,128 2>&1 | tee "$out/bench-offline.log" || status=1
# GGUF blocks kept quantized on the GPU against the same file dequantized to bf16: the 8B shape
# (SmolLM2's vocabulary) as Q4_0 blocks drawn at random.
/tmp/ferrite/bin/random_gguf /tmp/ferrite/models/smollm2-10l.gguf scripts/cuda/llama-3.1-8b.json \
  /tmp/ferrite/q4_0.gguf q4_0
for format in native f32; do
  /tmp/ferrite/bin/ferrite bench offline --device cuda /tmp/ferrite/q4_0.gguf --weight-format $format \
    --max-model-len 8192 --max-num-batched-tokens 8192 --prompt-tokens 4608 --batch 1,8,32 2>&1 \
    | tee "$out/bench-offline-q4_0-$format.log" || status=1
done
exit $status
