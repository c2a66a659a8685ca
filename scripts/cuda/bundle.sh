#!/usr/bin/env bash
# Builds ferrite with `--features cuda` and its CUDA test binary on a machine without a GPU,
# and packs them with a 10-layer cut of the test model (Q4_0 embedding, ~40 MB: the whole
# GGUF is too big to send) into .device/bin.tar.xz and .device/models.tar.xz, for a GPU
# host with no network. Send them in two calls (see the end of this script):
#   carry .device/models.tar.xz: mkdir -p /tmp/ferrite && xz -dc .device/models.tar.xz | tar -C /tmp/ferrite -xf -
#   carry .device/bin.tar.xz:    bash scripts/cuda/check.sh
# Usage: scripts/cuda/bundle.sh   (first time: scripts/cuda/setup-toolchain.sh)
# On the GPU host: scripts/cuda/check.sh runs the tests and the device benchmark,
# scripts/cuda/serve-peer.sh the served benchmark against transformers.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
toolkit=${CUDA_TOOLKIT_DIR:-$HOME/.cache/ferrite-cuda}
if [ ! -f "$toolkit/env.sh" ]; then
  cargo fetch >/dev/null
  CUDA_TOOLKIT_DIR=$toolkit bash scripts/cuda/setup-toolchain.sh
fi
# shellcheck disable=SC1091
source "$toolkit/env.sh"
export CARGO_TARGET_DIR=$root/target-cuda
cargo build --release --features cuda -p ferrite
tests=$(cargo test --release --features cuda -p ferrite-model --test cuda --no-run \
  --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])')
# The tensor/pipeline-parallel tests (ranks under mpirun; Open MPI from scripts/mpi-deps.sh),
# a binary of their own: it links libmpi, which the other tests do not need on the GPU host.
bash scripts/mpi-deps.sh
parallel_tests=$(cargo test --release --features cuda,mpi -p ferrite-model --test cuda_parallel --no-run \
  --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_parallel":
        print(m["executable"])')
model=$(scripts/fetch-model.sh smollm2)
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/models"
cp target-cuda/release/ferrite "$stage/bin/ferrite"
cp "$tests" "$stage/bin/cuda-tests"
# Writes the llama.cpp peer's GGUF there (serve-peer.sh llamacpp-build).
cargo build --release -q -p ferrite-model --example random_gguf
cp target-cuda/release/examples/random_gguf "$stage/bin/random_gguf"
mkdir -p "$stage/parallel/bin"
cp "$parallel_tests" "$stage/parallel/bin/cuda-parallel-tests"
strip "$stage/bin/ferrite" "$stage/bin/cuda-tests" "$stage/bin/random_gguf" "$stage/parallel/bin/cuda-parallel-tests"
cargo run --release -q -p ferrite-model --example cut_gguf -- "$model" "$stage/models/smollm2-10l.gguf" 10 q4_0
# The 8B shape with SmolLM2's tokenizer, for the served peer benchmark (serve-peer.sh).
cargo run --release -q -p ferrite-model --example hf_folder -- "$model" scripts/cuda/llama-3.1-8b.json \
  "$stage/models/llama-8b-shape"
# Two archives: with the working tree both exceed what one device call carries (64 MiB), so
# the models travel in a first call that unpacks them into /tmp/ferrite, the binaries in the
# call that runs check.sh (the machine keeps /tmp while it stays warm).
mkdir -p .device
rm -f .device/bundle.tar.xz
tar -C "$stage" -cf - bin | xz -6 -T2 > .device/bin.tar.xz
tar -C "$stage" -cf - models | xz -6 -T2 > .device/models.tar.xz
# A third for the parallel tests: scripts/cuda/parallel.sh.
tar -C "$stage/parallel" -cf - bin | xz -6 -T2 > .device/parallel.tar.xz
ls -la .device/bin.tar.xz .device/models.tar.xz .device/parallel.tar.xz
