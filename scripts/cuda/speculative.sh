#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with the archives of scripts/cuda/bundle.sh
# (the models unpacked into /tmp/ferrite by an earlier call, .device/bin.tar.xz carried; or one
# archive of bin/ferrite, bin/cuda-tests and a shorter cut, models/smollm2-4l.gguf): the
# CUDA tests of graphs and speculation, the verify step's cost against a decode step on the
# Llama-3.1-8B shape, and n-gram speculation served on and off (the `copy` split of
# scripts/bench-speculative.py, the cut test model). Logs go to $OUT (or /tmp/ferrite-out).
# Env: BATCH (device bench batches; none skips it), CONCURRENCY, ROUNDS, SPLITS (n-gram run;
# default copy; none skips it), EAGER_CONTROL, SERVE_ARGS (more `ferrite serve` flags for the served runs, e.g.
# --batch-invariant), BENCH_ARGS (more `ferrite bench device` flags), TESTS (test name filters; default: graphs, verify windows, greedy
# identity, speculation).
set -euo pipefail
out=${OUT:-/tmp/ferrite-out}
mkdir -p "$out" /tmp/ferrite
for a in .device/*.tar.xz; do xz -dc "$a" | tar -C /tmp/ferrite -xf -; done
model=$(ls /tmp/ferrite/models/smollm2-*l.gguf 2>/dev/null | head -1)
[ -n "$model" ] || { echo "models not unpacked: see scripts/cuda/bundle.sh" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
status=0
for filter in ${TESTS:-graphs verify_windows greedy_output speculation}; do
  ( root=$PWD && cd /tmp/ferrite && FERRITE_CUDA_TEST_MODEL=$model \
      FERRITE_REPO_ROOT=$root ./bin/cuda-tests --test-threads 1 --nocapture "$filter" ) 2>&1 \
    | tee -a "$out/tests.log" | grep -E "^test |test result|graphs vs eager|identical|drafts" || status=1
done
if [ "${BATCH:-}" != none ]; then
  /tmp/ferrite/bin/ferrite bench device scripts/cuda/llama-3.1-8b.json --batch ${BATCH:-1,2,4,8,32} \
    --verify-k 1,2,4 --repeats 6 --prompt-tokens 512 ${BENCH_ARGS:-} > "$out/bench-device.log" 2>&1 || status=1
  grep -E "^\| (verify batch|[0-9]+ \| [0-9]+ \| [0-9]+ \| (CUDA graph|eager))" "$out/bench-device.log" || true
fi
[ "${SPLITS:-}" = none ] || python3 scripts/bench-speculative.py --binary /tmp/ferrite/bin/ferrite \
  --model "$model" --serve-args "--device cuda ${SERVE_ARGS:-}" --splits ${SPLITS:-copy} \
  --concurrency ${CONCURRENCY:-1,4,16} --rounds ${ROUNDS:-2} --machine "$(head -2 "$out/gpu.txt" | tail -1)" \
  --out "$out/h200-speculative-copy.md" 2>&1 | tail -8 || status=1
# A draft model (the first 2 layers, `draft.tar.xz`), when one was unpacked.
draft=$(ls /tmp/ferrite/models/draft-*.gguf 2>/dev/null | head -1)
[ -z "$draft" ] || python3 scripts/bench-speculative.py --binary /tmp/ferrite/bin/ferrite \
  --model "$model" --serve-args "--device cuda ${SERVE_ARGS:-}" --splits copy --draft "$draft" --k 3 \
  --concurrency ${CONCURRENCY:-1,4,16} --rounds ${ROUNDS:-2} --machine "$(head -2 "$out/gpu.txt" | tail -1)" \
  --out "$out/h200-speculative-draft.md" 2>&1 | tail -8 || status=1
# The control: verify steps run eagerly (decodes too), as before verify steps had graphs.
[ -z "${EAGER_CONTROL:-}" ] || python3 scripts/bench-speculative.py --binary /tmp/ferrite/bin/ferrite \
  --model "$model" --serve-args "--device cuda --enforce-eager" --splits copy \
  --concurrency 1 --rounds 1 --machine "$(head -2 "$out/gpu.txt" | tail -1)" \
  --out "$out/h200-speculative-copy-eager.md" 2>&1 | tail -5 || status=1
exit $status
